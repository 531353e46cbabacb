// tiller bench generate: the engine's generation throughput on a preset shape with random
// weights (B prompts of P random tokens, N new tokens each, temperature-1 sampling, no stop
// tokens), with the memory-bandwidth floor of a decode step. Prints JSON. With --profile, a
// separate short run afterwards records a Chrome trace of --profile-steps decode steps. With
// --tp N under `mpirun -np N`, one engine of tensor parallelism N: each rank holds its slice of
// the weights (engine_weights.h), rank 0 leads and measures, the others follow its steps.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "step_profiler.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/core/logging.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/model/fp8.h"
#include "tiller/model/weights.h"

namespace tiller::cli {
namespace {

struct GenBenchOptions {
  std::string model = "qwen2-0.5b", device = "auto", dtype = "bf16", out, logprob_match = "off", experts = "auto";
  int64_t batch = 64, prompt = 128, new_tokens = 256, block_size = 16;
  int64_t max_batched_tokens = 0;  // 0: max(8192, prompt x min(batch, 64))
  double hbm_gbps = 4300;  // measured H200 copy bandwidth (DESIGN.md §7), for the floor
  bool no_cuda_graphs = false;
  bool no_async = false;
  bool no_rope_in_attention = false;
  int64_t decode_pack_keys = engine::EngineOptions{}.decode_pack_keys;
  bool fp8 = false;  // also an FP8 engine on the same weights, after the bf16 one
  bool fp8_kv = false;  // that engine (or, without fp8, a bf16 one) with an FP8 KV cache
  std::string fp8_scaling = "block";
  bool fp8_unfused = false;  // with --fp8 and tensor scaling: also the FP8 engine without its fused quantization
  std::string profile;
  int64_t profile_steps = 5;
  int tp = 1;                   // > 1: one engine over that many ranks (mpirun -np tp)
  std::string backend = "auto";  // the TP group's: auto, nccl or mpi
  double timeout_s = 300;
};

using Clock = std::chrono::steady_clock;

int run_bench_generate(const GenBenchOptions& o, int* argc, char*** argv) {
  if (o.fp8_unfused && !(o.fp8 && o.fp8_scaling == "tensor"))
    throw ConfigError("bench generate --fp8-unfused compares tensor scaling's fused layers: add --fp8 --fp8-scaling tensor");
  apply_logprob_match(o.logprob_match);
  apply_expert_kernels(o.experts);
  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  std::string device = o.device == "auto" ? (gpus > 0 ? "cuda:0" : "cpu") : o.device;
  // --tp > 1: the TP group is the whole world; under NCCL each rank drives its local GPU.
  std::unique_ptr<dist::MpiEnv> env;
  RankComm rc;
  if (o.tp > 1) {
    env = std::make_unique<dist::MpiEnv>(argc, argv);
    log::init(env->rank(), "bench", log::Level::kWarn);
    rc = open_rank_comm(*env, o.backend, o.timeout_s, "bench.generate.tp");
    if (rc.comm().size() != o.tp) {
      throw ConfigError(fmt::format("bench generate --tp {}: launch {} ranks (mpirun -np {}); this run has {}", o.tp, o.tp,
                                    o.tp, rc.comm().size()));
    }
    if (rc.nccl) device = rc.device.str();
    else if (o.device == "auto") device = "cpu";
  }
  const at::ScalarType dtype = parse_dtype(o.dtype);
  const model::ModelConfig cfg = model::preset(o.model);
  model::ModelWeights w;
  {  // every rank makes the same full weights (seed 0) and keeps its slice
    model::NamedTensors named = model::init_weights(cfg, model::Head::kLm, 0, dtype, at::Device(device));
    w = model::bind_weights(cfg, named, model::Head::kLm, o.model);
    if (o.tp > 1) {
      w = engine::slice_for_tp(cfg, w, rc.comm().rank(), o.tp);
      // Row slices are views of the full matrices: copy them so that the full weights are freed.
      for (auto& l : w.layers) {
        for (at::Tensor* t : {&l.q_proj, &l.k_proj, &l.v_proj, &l.q_bias, &l.k_bias, &l.v_bias, &l.gate_proj, &l.up_proj}) {
          if (t->defined()) *t = t->clone();
        }
      }
    }
  }
  // One engine on `weights` (with `quantization`), measured; empty JSON on a TP follower.
  auto measure = [&](const std::string& quantization, const std::string& kv_cache_dtype, model::ModelWeights weights,
                     bool profile, bool fp8_fused = true) -> nlohmann::ordered_json {
  engine::EngineOptions eo;
  eo.quantization = quantization;
  eo.kv_cache_dtype = kv_cache_dtype;
  eo.fp8_scaling = o.fp8_scaling;
  eo.device = device;
  eo.block_size = o.block_size;
  eo.limits.max_num_seqs = o.batch;
  eo.limits.max_batched_tokens = o.max_batched_tokens > 0 ? o.max_batched_tokens
                                                           : std::max<int64_t>(8192, o.prompt * std::min<int64_t>(o.batch, 64));
  // On the CPU, what the batch needs at full length, twice over (the memory-sized cache of a GPU
  // would be gigabytes of zeros here).
  if (device == "cpu")
    eo.num_blocks = 2 * o.batch * ((o.prompt + o.new_tokens + o.block_size - 1) / o.block_size + 1);
  eo.cuda_graphs = !o.no_cuda_graphs;
  eo.async_scheduling = !o.no_async;
  eo.rope_in_attention = !o.no_rope_in_attention;
  eo.decode_pack_keys = o.decode_pack_keys;
  eo.fp8_fused = fp8_fused;
  engine::Engine e(cfg, std::move(weights), eo, o.tp > 1 ? &rc.comm() : nullptr);
  if (!e.is_leader()) {
    e.follow();  // the leader's steps, until its shutdown()
    return nlohmann::ordered_json();
  }

  std::mt19937_64 rng(1);
  auto run = [&](int64_t batch, int64_t new_tokens, uint64_t first_id) {
    for (int64_t i = 0; i < batch; ++i) {
      engine::Request r;
      r.id = first_id + static_cast<uint64_t>(i);
      r.prompt.resize(static_cast<size_t>(o.prompt));
      for (auto& t : r.prompt) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(cfg.vocab_size));
      r.params.temperature = 1.0;
      r.params.seed = r.id;
      r.params.max_new_tokens = new_tokens;
      e.add(std::move(r));
    }
    std::vector<double> decode_ms;
    double prefill_s = 0;
    const auto t0 = Clock::now();
    while (e.has_work()) {
      const auto s0 = Clock::now();
      e.step();
      const double dt = std::chrono::duration<double>(Clock::now() - s0).count();
      if (e.stats().last_step_prefill_tokens > 0) prefill_s += dt;
      else decode_ms.push_back(dt * 1e3);
    }
    const double total = std::chrono::duration<double>(Clock::now() - t0).count();
    return std::make_tuple(total, prefill_s, decode_ms);
  };
  run(o.batch, 4, 1u << 30);  // warm-up: allocator, kernels, the CUDA graph of this batch size
  const auto steps_before = e.stats();
  auto [total, prefill_s, decode_ms] = run(o.batch, o.new_tokens, 0);
  const auto stats = e.stats();
  std::sort(decode_ms.begin(), decode_ms.end());
  double sum = 0;
  for (double d : decode_ms) sum += d;
  const double step_ms = decode_ms.empty() ? 0 : sum / static_cast<double>(decode_ms.size());
  const double median_ms = decode_ms.empty() ? 0 : decode_ms[decode_ms.size() / 2];
  // Floor of a decode step: every weight read once, plus the KV cache read at the mean context
  // (the peer decode_peer.py counts its whole static cache, P + N); with TP, one rank's share
  // (its weight slices, the embedding and LM head whole, and 1/tp of the KV heads).
  // A mixture of experts reads the experts its batch routes to: under uniform routing each
  // expert of a sparse layer is missed by all `batch` tokens with probability (1 - k/E)^batch.
  double weight_bytes = 0, expert_share = 1;
  if (cfg.moe()) {
    const double k = static_cast<double>(cfg.experts_per_token), n = static_cast<double>(cfg.num_experts);
    expert_share = 1 - std::pow(1 - k / n, static_cast<double>(o.batch));
  }
  const bool fp8 = quantization == "fp8";
  for (const auto& [name, t] : e.parameters()) {
    const bool expert = name.find(".experts.") != std::string::npos;
    // An FP8 engine reads its projections (not the routed experts) as one byte per element.
    const bool in_fp8 = fp8 && !expert && name.find("_proj.weight") != std::string::npos;
    const double bytes = static_cast<double>(t.numel() * (in_fp8 ? 1 : t.element_size()));
    weight_bytes += expert ? bytes * expert_share : bytes;
  }
  // An FP8 cache: a byte per element and a 4-byte scale per (token, KV head).
  const double kv_per_token =
      2.0 * static_cast<double>(cfg.num_layers * cfg.num_kv_heads) *
      (kv_cache_dtype == "fp8" ? static_cast<double>(cfg.head_dim + 4)
                               : static_cast<double>(cfg.head_dim * at::elementSize(dtype))) /
      static_cast<double>(o.tp);
  const double mean_ctx = static_cast<double>(o.prompt) + static_cast<double>(o.new_tokens) / 2;
  const double floor_ms = (weight_bytes + kv_per_token * mean_ctx * static_cast<double>(o.batch)) / (o.hbm_gbps * 1e9) * 1e3;
  nlohmann::ordered_json j{{"bench", "tiller_generate"},
                           {"logprob_match", o.logprob_match},
                           {"experts", cfg.moe() ? o.experts : "dense"},
                           {"expert_share_read", expert_share},
                           {"model", o.model},
                           {"device", device},
                           {"dtype", o.dtype},
                           {"quantization", quantization},
                           {"fp8_scaling", quantization == "fp8" ? o.fp8_scaling : ""},
                           {"fp8_tensor_cores", fp8 && model::fp8::tensor_cores(at::Device(device))},
                           {"kv_cache_dtype", kv_cache_dtype},
                           {"tp", o.tp},
                           {"batch", o.batch},
                           {"prompt", o.prompt},
                           {"new_tokens", o.new_tokens},
                           {"total_s", total},
                           {"prefill_s", prefill_s},
                           {"tokens_per_s", static_cast<double>(o.batch * o.new_tokens) / total},
                           {"decode_steps", decode_ms.size()},
                           {"step_ms", step_ms},
                           {"step_ms_median", median_ms},
                           {"decode_tokens_per_s", step_ms > 0 ? static_cast<double>(o.batch) / step_ms * 1e3 : 0},
                           {"floor_step_ms", floor_ms},
                           {"x_floor", floor_ms > 0 ? step_ms / floor_ms : 0},
                           {"paged_decode", e.paged_decode()},
                           {"cuda_graphs", e.cuda_graphs()},
                           {"async_scheduling", eo.async_scheduling},
                           {"rope_in_attention", eo.rope_in_attention},
                           {"decode_pack_keys", eo.decode_pack_keys},
                           {"fp8_fused", eo.fp8_fused},
                           {"launched_ahead", stats.launched_ahead - steps_before.launched_ahead},
                           {"preemptions", stats.preemptions - steps_before.preemptions},
                           {"kv_blocks", stats.kv_blocks_total}};
  if (profile) {  // the same batch again, a few decode steps under the profiler
    std::mt19937_64 prof_rng(2);
    for (int64_t i = 0; i < o.batch; ++i) {
      engine::Request r;
      r.id = (2ull << 30) + static_cast<uint64_t>(i);
      r.prompt.resize(static_cast<size_t>(o.prompt));
      for (auto& t : r.prompt) t = static_cast<int64_t>(prof_rng() % static_cast<uint64_t>(cfg.vocab_size));
      r.params.temperature = 1.0;
      r.params.seed = r.id;
      r.params.max_new_tokens = 8 + o.profile_steps;
      e.add(std::move(r));
    }
    int64_t decodes = 0;
    std::unique_ptr<StepProfiler> prof;
    while (e.has_work()) {
      if (decodes == 4 && !prof) prof = std::make_unique<StepProfiler>(true);
      e.step();
      if (e.stats().last_step_prefill_tokens == 0) ++decodes;
      if (prof && decodes == 4 + o.profile_steps) {
        prof->save(o.profile);
        prof.reset();
      }
    }
    j["profile"] = o.profile;
    j["profile_steps"] = o.profile_steps;
  }
  if (fp8 && o.tp == 1) {
    // What a weight sync adds on the engine's side: the FP8 copies quantized again (the median of 3).
    std::vector<double> t;
    for (int i = 0; i < 3; ++i) t.push_back(e.requantize());
    std::sort(t.begin(), t.end());
    j["fp8_requantize_s"] = t[1];
  }
  e.shutdown();  // ends the followers' follow()
  return j;
  };

  nlohmann::ordered_json j;
  if (!o.fp8 && !o.fp8_kv) {
    j = measure("none", "auto", std::move(w), !o.profile.empty());
  } else {
    // The same weights twice: the bf16 engine first (its fused copies are freed with it), then the
    // FP8 one (FP8 weights, an FP8 KV cache, or both), and their ratio.
    const nlohmann::ordered_json base = measure("none", "auto", w, false);
    const nlohmann::ordered_json unfused =
        o.fp8 && o.fp8_unfused ? measure("fp8", o.fp8_kv ? "fp8" : "auto", w, false, /*fp8_fused=*/false)
                               : nlohmann::ordered_json();
    const nlohmann::ordered_json q =
        measure(o.fp8 ? "fp8" : "none", o.fp8_kv ? "fp8" : "auto", std::move(w), !o.profile.empty());
    if (!base.is_null()) {
      const double b = base["decode_tokens_per_s"].get<double>(), f = q["decode_tokens_per_s"].get<double>();
      j = {{"bench", "tiller_generate_fp8"}, {"bf16", base}, {"fp8", q},
           {"fp8_decode_speedup", b > 0 ? f / b : 0},
           {"fp8_speedup", base["tokens_per_s"].get<double>() > 0
                               ? q["tokens_per_s"].get<double>() / base["tokens_per_s"].get<double>() : 0}};
      if (!unfused.is_null()) {
        const double u = unfused["decode_tokens_per_s"].get<double>();
        j["fp8_unfused"] = unfused;
        j["fp8_unfused_decode_speedup"] = b > 0 ? u / b : 0;
        j["fusion_decode_speedup"] = u > 0 ? f / u : 0;
      }
    }
  }
  if (j.is_null()) return 0;  // a TP follower
  const std::string text = j.dump();
  std::printf("%s\n", text.c_str());
  if (!o.out.empty()) write_file_atomic(o.out, text + "\n");
  return 0;
}

}  // namespace

void add_bench_generate(CLI::App* bench, Runner& run, int& argc, char**& argv) {
  auto* g = bench->add_subcommand("generate", "Engine generation throughput on a preset shape (random weights)");
  auto o = std::make_shared<GenBenchOptions>();
  g->add_option("--model", o->model, "Preset shape: qwen2-0.5b, qwen2-1.5b, qwen2-7b, tiny-*");
  g->add_option("--batch", o->batch, "Prompts (all submitted at once)")->check(CLI::Range(1, 1 << 16));
  g->add_option("--prompt-len", o->prompt, "Tokens per prompt")->check(CLI::Range(1, 1 << 20));
  g->add_option("--new-tokens", o->new_tokens, "Tokens generated per prompt")->check(CLI::Range(1, 1 << 20));
  g->add_option("--block-size", o->block_size, "KV block size")->check(CLI::Range(1, 1024));
  g->add_option("--max-batched-tokens", o->max_batched_tokens,
                "Most tokens one engine step takes (engines.max_batched_tokens); 0: max(8192, prompt x min(batch, 64)). "
                "The engine keeps room for a step's activations beside its KV cache (docs/engine.md), so a larger value "
                "leaves fewer KV blocks")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  g->add_option("--device", o->device, "auto, cpu or cuda[:N]");
  g->add_option("--dtype", o->dtype, "bf16, fp16 or fp32");
  g->add_option("--hbm-gbps", o->hbm_gbps, "Memory bandwidth for the floor, GB/s")->check(CLI::Range(1.0, 1e6));
  g->add_option("--out", o->out, "Also write the JSON here");
  g->add_flag("--no-cuda-graphs", o->no_cuda_graphs, "Run decode steps eagerly");
  g->add_flag("--fp8", o->fp8,
              "Measure an FP8 engine (engines.quantization: fp8) after the bf16 one, on the same weights, and report "
              "both and their ratio");
  g->add_option("--fp8-scaling", o->fp8_scaling, "The FP8 engine's scales: block, channel or tensor")
      ->check(CLI::IsMember({"channel", "block", "tensor"}));
  g->add_flag("--fp8-unfused", o->fp8_unfused,
              "With --fp8 --fp8-scaling tensor: also measure the FP8 engine with one FP8 linear at a time "
              "(engines' fp8_fused off: the same numerics), between the bf16 and the fused ones, and report the ratio");
  g->add_flag("--fp8-kv", o->fp8_kv,
              "Give the FP8 engine (or, without --fp8, a second bf16 engine) an FP8 KV cache "
              "(engines.kv_cache_dtype: fp8) and report it against the bf16 one");
  add_logprob_match(g, o->logprob_match);
  add_expert_kernels(g, o->experts);
  g->add_flag("--no-rope-in-attention", o->no_rope_in_attention,
              "Rotate q and k with a RoPE kernel before decode attention instead of inside it");
  g->add_option("--decode-pack-keys", o->decode_pack_keys,
                "Decode attention serves a sequence's KV head on one warp instead of four while its keys (per KV "
                "split) number at most this; 0: always four")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  g->add_flag("--no-async-scheduling", o->no_async,
              "Wait for each step's draws before launching the next (no host/GPU overlap)");
  g->add_option("--profile", o->profile, "Write a Chrome trace of --profile-steps decode steps here");
  g->add_option("--profile-steps", o->profile_steps, "Decode steps in the trace")->check(CLI::Range(1, 100));
  g->add_option("--tp", o->tp,
                "Tensor parallelism: one engine over this many ranks, launched with mpirun -np TP (rank 0 measures)")
      ->check(CLI::Range(1, 64));
  g->add_option("--backend", o->backend, "The TP group's backend with --tp > 1: auto, nccl or mpi");
  g->add_option("--timeout", o->timeout_s, "Seconds a TP rank waits for the others")->check(CLI::Range(1.0, 86400.0));
  g->callback([&run, &argc, &argv, o] { run = [o, &argc, &argv] { return run_bench_generate(*o, &argc, &argv); }; });
}

}  // namespace tiller::cli
