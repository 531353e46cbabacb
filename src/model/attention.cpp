#include "tiller/model/attention.h"

#include <ATen/ATen.h>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "model/batch_invariant.h"
#include "model/torch_compat.h"
#include "tiller/core/error.h"
#include "tiller/model/numerics.h"

namespace tiller::model {

VarlenSpec VarlenSpec::self(const at::Tensor& cu, std::vector<int64_t> lens) {
  VarlenSpec s;
  s.cu_q = s.cu_k = cu;
  for (int64_t l : lens) s.max_q = std::max(s.max_q, l);
  s.max_k = s.max_q;
  s.lens_q = lens;
  s.lens_k = std::move(lens);
  return s;
}

bool flash_attention_applies(const at::Tensor& q) {
  const int64_t d = q.size(-1);
  return q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) && d % 8 == 0 && d <= 256;
}

namespace {

at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& s,
                               double scale) {
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  const int64_t groups = heads / kv_heads;
  std::vector<at::Tensor> outs;
  outs.reserve(s.lens_q.size());
  int64_t sq = 0, sk = 0;
  const auto compute = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  for (size_t i = 0; i < s.lens_q.size(); ++i) {
    const int64_t lq = s.lens_q[i], lk = s.lens_k[i];
    if (lq == 0) {
      sk += lk;
      continue;
    }
    at::Tensor qi = q.narrow(0, sq, lq).transpose(0, 1).to(compute);  // [H, lq, D]
    at::Tensor ki = k.narrow(0, sk, lk).transpose(0, 1).to(compute);  // [Hk, lk, D]
    at::Tensor vi = v.narrow(0, sk, lk).transpose(0, 1).to(compute);
    if (groups > 1) {
      ki = ki.repeat_interleave(groups, 0);
      vi = vi.repeat_interleave(groups, 0);
    }
    at::Tensor scores = at::matmul(qi, ki.transpose(1, 2)) * scale;  // [H, lq, lk]
    // Query j sits at key position j + lk - lq; it sees keys at or before it (within the window).
    auto opts = at::TensorOptions().dtype(at::kLong).device(q.device());
    at::Tensor qpos = at::arange(lq, opts).unsqueeze(1) + (lk - lq);
    at::Tensor kpos = at::arange(lk, opts).unsqueeze(0);
    at::Tensor blocked = kpos > qpos;
    if (s.window > 0) blocked = blocked.logical_or(qpos - kpos >= s.window);
    scores = scores.masked_fill(blocked, -std::numeric_limits<double>::infinity());
    at::Tensor out = at::matmul(at::softmax(scores, -1), vi);  // [H, lq, D]
    outs.push_back(out.transpose(0, 1).to(q.scalar_type()));
    sq += lq;
    sk += lk;
  }
  TILLER_CHECK(sq == q.size(0) && sk == k.size(0), "varlen attention: lengths cover {} of {} queries and {} of {} keys",
               sq, q.size(0), sk, k.size(0));
  if (outs.empty()) return at::zeros_like(q);
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

// Numerics::kBatchInvariant: the invariant kernel forward, the reference's gradient backward.
struct InvariantAttention : public torch::autograd::Function<InvariantAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const VarlenSpec& spec, double scale) {
    ctx->save_for_backward({q, k, v});
    // The reference reads the lengths and the window only.
    ctx->saved_data["lens_q"] = spec.lens_q;
    ctx->saved_data["lens_k"] = spec.lens_k;
    ctx->saved_data["window"] = spec.window;
    ctx->saved_data["scale"] = scale;
    // On CUDA the backward recomputes with flash attention (its own forward and backward), which
    // needs the device lengths; elsewhere the reference's.
    const bool flash = flash_attention_applies(q) && spec.cu_q.defined() && spec.cu_k.defined();
    ctx->saved_data["flash"] = flash;
    if (flash) {
      ctx->saved_data["cu_q"] = spec.cu_q;
      ctx->saved_data["cu_k"] = spec.cu_k;
      ctx->saved_data["max_q"] = spec.max_q;
      ctx->saved_data["max_k"] = spec.max_k;
    }
    return invariant::attention_forward(q, k, v, spec, scale);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> in, want;
    for (int i = 0; i < 3; ++i) {
      in.push_back(saved[static_cast<size_t>(i)].detach().requires_grad_(ctx->needs_input_grad(i)));
      if (in.back().requires_grad()) want.push_back(in.back());
    }
    if (want.empty()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    VarlenSpec spec;
    spec.lens_q = ctx->saved_data["lens_q"].toIntVector();
    spec.lens_k = ctx->saved_data["lens_k"].toIntVector();
    spec.window = ctx->saved_data["window"].toInt();
    at::Tensor out;
    {
      at::AutoGradMode on(true);
      const double scale = ctx->saved_data["scale"].toDouble();
      if (ctx->saved_data["flash"].toBool())
        out = compat::flash_attention_varlen(in[0].contiguous(), in[1].contiguous(), in[2].contiguous(),
                                             ctx->saved_data["cu_q"].toTensor(), ctx->saved_data["cu_k"].toTensor(),
                                             ctx->saved_data["max_q"].toInt(), ctx->saved_data["max_k"].toInt(), scale,
                                             spec.window > 0 ? spec.window - 1 : -1);
      else
        out = reference_attention(in[0], in[1], in[2], spec, scale);
    }
    const auto g = torch::autograd::grad({out}, want, {grads[0]}, false, false, true);
    torch::autograd::variable_list r(5);
    size_t j = 0;
    for (size_t i = 0; i < 3; ++i)
      if (in[i].requires_grad()) r[i] = g[j++];
    return r;
  }
};

}  // namespace

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& spec,
                            double scale, AttentionBackend backend) {
  TILLER_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attention wants [tokens, heads, head_dim] inputs");
  TILLER_CHECK(q.size(1) % k.size(1) == 0, "{} query heads are not a multiple of {} kv heads", q.size(1), k.size(1));
  TILLER_CHECK(spec.lens_q.size() == spec.lens_k.size(), "varlen attention: {} query and {} key sequences",
               spec.lens_q.size(), spec.lens_k.size());
  if (batch_invariant()) return InvariantAttention::apply(q, k, v, spec, scale);
  const bool flash = backend == AttentionBackend::kFlash ||
                     (backend == AttentionBackend::kAuto && flash_attention_applies(q));
  if (!flash) return reference_attention(q, k, v, spec, scale);
  TILLER_CHECK(flash_attention_applies(q), "flash attention needs CUDA bf16/fp16 inputs with head_dim % 8 == 0 and <= 256");
  return compat::flash_attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), spec.cu_q, spec.cu_k,
                                        spec.max_q, spec.max_k, scale, spec.window > 0 ? spec.window - 1 : -1);
}

}  // namespace tiller::model
