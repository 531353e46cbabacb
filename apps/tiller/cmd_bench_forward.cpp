// tiller bench forward: tokens/s and achieved TFLOP/s of the functional model's forward and
// forward+backward (packed sequences, chunked log-probs as the loss), next to the bf16 matmul
// rate measured in the same run on the same device. Prints one JSON object.
//
// FLOPs counted: 2 x (matmul parameters, LM head included, embedding excluded) per token, plus
// causal attention 2 x 2 x seq/2 x (heads x head_dim) per token and layer; backward = 2 x forward.
// --fp8 times both again with FP8 training's GEMMs (roles.<r>.fp8, --fp8-scaling) on the same
// weights and reports them beside, with the speedups.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <CLI/CLI.hpp>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "model/torch_compat.h"
#include "tiller/core/clock.h"
#include "tiller/core/error.h"
#include "tiller/model/fp8.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"

namespace tiller::cli {
namespace {

struct ForwardOptions {
  std::vector<std::string> models{"qwen2-0.5b"};
  int64_t seq = 2048;
  int64_t micro_batch = 4;
  std::string dtype = "bf16";
  std::string device = "auto";
  int warmup = 2;
  int iters = 5;
  std::string out;
  std::string logprob_match = "off";
  std::string experts = "auto";
  bool fp8 = false;
  std::string fp8_scaling = "block";
};

using Clock = std::chrono::steady_clock;


// Mean seconds of fn() over `iters` after `warmup`, synchronising the device around the timing.
template <typename F>
double time_it(const at::Device& dev, int warmup, int iters, F&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  compat::synchronize(dev);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  compat::synchronize(dev);
  return seconds_since(t0) / iters;
}

double matmul_tflops(const at::Device& dev, at::ScalarType dtype) {
  const int64_t n = dev.is_cpu() ? 1024 : 8192;
  at::Tensor a = at::randn({n, n}, at::TensorOptions().device(dev).dtype(dtype));
  at::Tensor b = at::randn({n, n}, a.options());
  at::Tensor c = at::empty({n, n}, a.options());
  const double s = time_it(dev, 3, dev.is_cpu() ? 3 : 50, [&] { at::mm_out(c, a, b); });
  return 2.0 * n * n * n / s / 1e12;
}

nlohmann::ordered_json bench_model(const std::string& name, const ForwardOptions& o, const at::Device& dev,
                                   at::ScalarType dtype, double peak_tflops) {
  model::ModelConfig cfg = model::preset(name);
  model::NamedTensors params = model::init_weights(cfg, model::Head::kLm, 1, dtype, dev);
  model::ModelWeights w = model::bind_weights(cfg, params, model::Head::kLm, name);
  const int64_t tokens = o.seq * o.micro_batch;
  std::vector<std::vector<int64_t>> seqs;
  at::Generator gen = at::detail::createCPUGenerator(2);
  for (int64_t i = 0; i < o.micro_batch; ++i) {
    at::Tensor t = at::randint(0, cfg.vocab_size, {o.seq}, gen, at::kLong);
    seqs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + o.seq);
  }
  model::PackedBatch batch = model::PackedBatch::pack(seqs, dev);
  at::Tensor targets = batch.tokens.roll(-1);

  // minus the embedding; a mixture of experts multiplies by the experts each token routes to
  int64_t matmul_params = model::active_parameters(cfg) - cfg.vocab_size * cfg.hidden_size;
  if (cfg.tie_word_embeddings) matmul_params += cfg.vocab_size * cfg.hidden_size;         // the head still multiplies
  const double attn_flops = 2.0 * 2.0 * (o.seq / 2.0) * cfg.q_size() * cfg.num_layers;
  const double fwd_flops = tokens * (2.0 * matmul_params + attn_flops);

  std::optional<model::fp8::Scaling> fp8;
  auto forward = [&] {
    at::Tensor h = model::forward_hidden(cfg, w, batch, nullptr, model::AttentionBackend::kAuto, fp8);
    return model::token_logprobs(h, w.lm_head, targets, 1.0, 2048);
  };
  struct Timed {
    double fwd_s, fb_s;
    int64_t fwd_peak, fb_peak;
  };
  auto measure = [&] {
    Timed t{};
    for (auto& [n, p] : params) p.requires_grad_(false);
    compat::reset_peak(dev);
    {
      c10::AutoGradMode no_grad(false);
      t.fwd_s = time_it(dev, o.warmup, o.iters, forward);
    }
    t.fwd_peak = compat::peak_allocated_bytes(dev);
    for (auto& [n, p] : params) p.requires_grad_(true);
    compat::reset_peak(dev);
    t.fb_s = time_it(dev, o.warmup, o.iters, [&] {
      for (auto& [n, p] : params) p.mutable_grad().reset();
      forward().mean().backward();
    });
    for (auto& [n, p] : params) p.mutable_grad().reset();
    t.fb_peak = compat::peak_allocated_bytes(dev);
    return t;
  };
  const Timed base = measure();

  auto phase = [&](double s, double flops, int64_t peak) {
    const double tflops = flops / s / 1e12;
    nlohmann::ordered_json j;
    j["ms"] = s * 1e3;
    j["tokens_per_s"] = tokens / s;
    j["tflops"] = tflops;
    j["fraction_of_matmul_rate"] = tflops / peak_tflops;
    if (peak > 0) j["peak_gib"] = peak / double(1 << 30);
    return j;
  };
  nlohmann::ordered_json r;
  r["model"] = name;
  r["parameters"] = model::num_parameters(cfg);
  r["tokens"] = tokens;
  r["forward"] = phase(base.fwd_s, fwd_flops, base.fwd_peak);
  r["forward_backward"] = phase(base.fb_s, 3 * fwd_flops, base.fb_peak);
  if (o.fp8) {
    fp8 = model::fp8::parse_scaling(o.fp8_scaling, "--fp8-scaling");
    const Timed q = measure();
    nlohmann::ordered_json f;
    f["scaling"] = o.fp8_scaling;
    // forward_hidden's default, where tensor scaling runs on tensor cores (the emulation: fp32).
    f["forward_accumulation"] = o.fp8_scaling == "tensor" && model::fp8::tensor_cores(dev) ? "fast" : "fp32";
    f["tensor_cores"] = model::fp8::tensor_cores(dev);
    // TFLOP/s as counted for bf16 (the same work), so the two compare directly.
    f["forward"] = phase(q.fwd_s, fwd_flops, q.fwd_peak);
    f["forward_backward"] = phase(q.fb_s, 3 * fwd_flops, q.fb_peak);
    f["forward_speedup"] = base.fwd_s / q.fwd_s;
    f["forward_backward_speedup"] = base.fb_s / q.fb_s;
    r["fp8"] = f;
  }
  return r;
}

int run_forward(const ForwardOptions& o) {
  apply_logprob_match(o.logprob_match);
  apply_expert_kernels(o.experts);
  at::Device dev = at::kCPU;
  if (o.device == "auto") {
    if (at::detail::getCUDAHooks().getNumGPUs() > 0) dev = at::Device(at::kCUDA, 0);
  } else {
    dev = at::Device(o.device);
  }
  const at::ScalarType dtype = parse_dtype(o.dtype);
  const double peak = matmul_tflops(dev, dtype);
  nlohmann::ordered_json out;
  out["bench"] = "forward";
  out["device"] = dev.str();
  out["dtype"] = o.dtype;
  out["seq"] = o.seq;
  out["micro_batch"] = o.micro_batch;
  out["logprob_match"] = o.logprob_match;
  out["experts"] = o.experts;
  if (o.logprob_match == "bitwise")
    out["attention"] = dev.is_cuda() ? "batch-invariant (the decode kernel's order)" : "batch-invariant (key order)";
  else
    out["attention"] = dev.is_cuda() && dtype != at::kFloat ? "flash (ATen varlen)" : "reference";
  out["matmul_tflops"] = peak;
  out["results"] = nlohmann::ordered_json::array();
  for (const auto& name : o.models) {
    out["results"].push_back(bench_model(name, o, dev, dtype, peak));
    std::fprintf(stderr, "%s\n", out["results"].back().dump().c_str());
  }
  emit_json(out.dump(2), o.out);
  return 0;
}

}  // namespace

void add_bench_forward(CLI::App* bench, Runner& run) {
  auto* fw = bench->add_subcommand("forward", "Model forward and forward+backward throughput on one device");
  auto o = std::make_shared<ForwardOptions>();
  fw->add_option("--model", o->models, "Presets, comma-separated (qwen2-0.5b, qwen2-1.5b, qwen2-7b, tiny-*)")->delimiter(',');
  fw->add_option("--seq", o->seq, "Tokens per sequence")->check(CLI::Range(1, 1 << 20));
  fw->add_option("--micro-batch", o->micro_batch, "Sequences packed per step")->check(CLI::Range(1, 4096));
  fw->add_option("--dtype", o->dtype, "bf16, fp16 or fp32");
  fw->add_option("--device", o->device, "auto, cpu or cuda[:N]");
  fw->add_option("--warmup", o->warmup, "Untimed steps")->check(CLI::Range(0, 100));
  fw->add_option("--iters", o->iters, "Timed steps")->check(CLI::Range(1, 1000));
  fw->add_option("--out", o->out, "Also write the JSON here");
  add_logprob_match(fw, o->logprob_match);
  add_expert_kernels(fw, o->experts);
  fw->add_flag("--fp8", o->fp8,
               "Also time forward and forward+backward with FP8 training's GEMMs (roles.<r>.fp8) on the same weights, "
               "reported beside bf16 with the speedups");
  fw->add_option("--fp8-scaling", o->fp8_scaling, "The FP8 GEMMs' scales: block, channel or tensor")
      ->check(CLI::IsMember({"block", "channel", "tensor"}));
  fw->callback([&run, o] { run = [o] { return run_forward(*o); }; });
}

}  // namespace tiller::cli
