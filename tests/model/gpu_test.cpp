// The model on CUDA in bf16 (flash attention) against the fp32 CPU path. Skipped without a GPU.
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "fixtures.h"
#include "tiller/model/attention.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"

namespace tiller::model {
namespace {

bool have_gpu() { return at::detail::getCUDAHooks().getNumGPUs() > 0; }

// |a - b| relative to the size of b: max over elements of |a-b| / (max |b|), and the relative
// Frobenius error. bf16 keeps ~3 significant digits.
struct Diff {
  double max_rel, frob_rel;
};
Diff compare(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.to(at::kCPU, at::kDouble), y = b.to(at::kCPU, at::kDouble);
  const double scale = y.abs().max().item<double>();
  return {(x - y).abs().max().item<double>() / scale, ((x - y).norm() / y.norm()).item<double>()};
}

std::vector<std::vector<int64_t>> inputs() {
  std::vector<std::vector<int64_t>> seqs;
  at::Generator gen = at::detail::createCPUGenerator(5);
  for (int64_t len : {64, 200, 33, 511}) {
    at::Tensor t = at::randint(3, 300, {len}, gen, at::kLong);
    seqs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + len);
  }
  return seqs;
}

TEST(ModelGpu, FlashAttentionEqualsReferenceForwardAndBackward) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  at::manual_seed(3);
  const std::vector<int64_t> lens{7, 128, 1, 300};
  const int64_t t = 436;
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::Tensor q = at::randn({t, 8, 64}, opts).requires_grad_();
  at::Tensor k = at::randn({t, 2, 64}, opts).requires_grad_();
  at::Tensor v = at::randn({t, 2, 64}, opts).requires_grad_();
  at::Tensor cu = at::tensor({0, 7, 135, 136, 436}, at::kInt).to(at::kCUDA);
  for (int64_t window : {0, 32}) {
    VarlenSpec spec = VarlenSpec::self(cu, lens);
    spec.window = window;
    at::Tensor g = at::randn({t, 8, 64}, opts);
    auto run = [&](AttentionBackend b, std::vector<at::Tensor>* grads) {
      for (at::Tensor* x : {&q, &k, &v}) x->mutable_grad().reset();
      at::Tensor o = varlen_attention(q, k, v, spec, 0.125, b);
      o.backward(g);
      *grads = {q.grad().clone(), k.grad().clone(), v.grad().clone()};
      return o;
    };
    std::vector<at::Tensor> grads_f, grads_r;
    at::Tensor of = run(AttentionBackend::kFlash, &grads_f);
    at::Tensor orf = run(AttentionBackend::kReference, &grads_r);
    EXPECT_LT(compare(of, orf).max_rel, 2e-2) << "window " << window;
    for (int i = 0; i < 3; ++i) EXPECT_LT(compare(grads_f[i], grads_r[i]).frob_rel, 2e-2) << "grad " << i << " window " << window;
  }
}

TEST(ModelGpu, Bf16ForwardAndBackwardMatchFp32Cpu) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const std::string name : {"qwen2", "qwen3", "mistral", "llama"}) {
    const std::string dir = test::hf_fixtures() + "/models/" + name;
    LoadedModel cpu = load_model(dir, Head::kLm, at::kFloat, at::kCPU);
    LoadedModel gpu = load_model(dir, Head::kLm, at::kBFloat16, at::kCUDA);
    auto seqs = inputs();
    std::vector<int64_t> targets;
    for (const auto& s : seqs) targets.insert(targets.end(), s.begin() + 1, s.end()), targets.push_back(0);
    at::Tensor tgt = at::tensor(targets, at::kLong);
    auto run = [&](LoadedModel& m, at::Device dev) {
      for (auto& [n, t] : m.tensors) t.requires_grad_(true);
      at::Tensor h = forward_hidden(m.config, m.weights, PackedBatch::pack(seqs, dev));
      at::Tensor lp = token_logprobs(h, m.weights.lm_head, tgt.to(dev), 1.0, 256);
      lp.mean().backward();
      return lp;
    };
    at::Tensor lp_cpu = run(cpu, at::kCPU);
    at::Tensor lp_gpu = run(gpu, at::kCUDA);
    const Diff d = compare(lp_gpu, lp_cpu);
    EXPECT_LT(d.frob_rel, 2e-2) << name << " log-probs";
    std::printf("[%s] log-probs bf16 GPU vs fp32 CPU: max rel %.3e, frob rel %.3e\n", name.c_str(), d.max_rel, d.frob_rel);
    for (const std::string p : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                "model.layers.2.mlp.down_proj.weight", "model.norm.weight"}) {
      const Diff g = compare(gpu.tensors.at(p).grad(), cpu.tensors.at(p).grad());
      EXPECT_LT(g.frob_rel, 5e-2) << name << " grad " << p;
      std::printf("[%s] grad %s: frob rel %.3e\n", name.c_str(), p.c_str(), g.frob_rel);
    }
  }
}

}  // namespace
}  // namespace tiller::model
