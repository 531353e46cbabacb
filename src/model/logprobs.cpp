// Log-probabilities of given tokens without materialising [T, vocab] fp32 logits: forward and
// backward both walk the rows in chunks and recompute each chunk's logits (a 150k vocabulary
// times 16k packed tokens would otherwise be ~10 GB per copy). On CUDA a chunk's logits stay in
// the weight dtype: one kernel per chunk reads them for the log-probs and entropies, and in the
// backward turns them into their gradient in place (src/model/cuda/logprob.cu), so no fp32
// [rows, vocab] tensor exists; elsewhere (and for fp64 gradient checks) ATen ops in fp32.
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/aten_dtype.h"
#endif

#include "model/batch_invariant.h"
#include "model/torch_compat.h"
#include "tiller/core/error.h"
#include "tiller/model/numerics.h"
#include "tiller/model/transformer.h"

namespace tiller::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ChunkResult {
  at::Tensor logprobs;  // [rows]
  at::Tensor entropy;   // [rows] or undefined
};

// fp32 at least; fp64 inputs stay fp64 (gradient checks).
at::ScalarType compute_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

#ifdef TILLER_HAVE_CUDA_KERNELS
using cuda::kernel_dtype;
void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// The fused kernels take CUDA logits of bf16, fp16 or fp32 (fp64 stays on ATen).
bool fused(const at::Tensor& h, const at::Tensor& w) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = h.scalar_type();
  return h.is_cuda() && w.scalar_type() == t && (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat);
#else
  (void)h;
  (void)w;
  return false;
#endif
}

ChunkResult chunk_forward(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, double temperature,
                          bool want_entropy) {
  if (batch_invariant()) {
    // The engine's head: logits rounded to the weights' dtype, then the one log-softmax kernel at
    // the temperature as the sampler holds it (fp32). The entropy need not be invariant.
    const at::Tensor z = invariant::linear(h, w);
    ChunkResult r;
    r.logprobs = invariant::logprobs(z, targets, {static_cast<float>(temperature)}, want_entropy ? &r.entropy : nullptr);
    return r;
  }
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (fused(h, w)) {
    const at::Tensor z = at::matmul(h, w.t()).contiguous();
    const at::Tensor tgt = targets.contiguous();
    ChunkResult r;
    r.logprobs = at::empty({h.size(0)}, h.options().dtype(at::kFloat));
    if (want_entropy) r.entropy = at::empty_like(r.logprobs);
    cuda::logprob_rows(kernel_dtype(z.scalar_type()), z.data_ptr(), z.size(0), z.size(1), z.stride(0),
                       tgt.data_ptr<int64_t>(), static_cast<float>(1.0 / temperature), r.logprobs.data_ptr<float>(),
                       want_entropy ? r.entropy.data_ptr<float>() : nullptr, stream_of(z));
    return r;
  }
#endif
  at::Tensor z = at::matmul(h, w.t()).to(compute_type(h));
  if (temperature != 1.0) z = z / temperature;
  at::Tensor lse = at::logsumexp(z, -1);
  ChunkResult r;
  r.logprobs = z.gather(1, targets.unsqueeze(1)).squeeze(1) - lse;
  if (want_entropy) {
    at::Tensor logp = z - lse.unsqueeze(1);
    r.entropy = -(logp.exp() * logp).sum(-1);
  }
  return r;
}

// d logp[t] / d z = onehot(target) - softmax(z), chunk by chunk with recomputed logits. With an
// entropy gradient too: d H / d z = -p * (log p + H). The weight gradient's matmul runs in the
// weight dtype (bf16 on tensor cores) and accumulates over chunks in fp32.
std::pair<at::Tensor, at::Tensor> backward_chunks(const at::Tensor& hidden, const at::Tensor& weight,
                                                  const at::Tensor& targets, const at::Tensor& grad,
                                                  const at::Tensor& grad_entropy, double temperature, int64_t chunk,
                                                  bool need_h, bool need_w, bool fp32_w = false,
                                                  const at::Tensor& grad_w_into = at::Tensor()) {
  const at::ScalarType ct = compute_type(hidden);
  const int64_t rows = hidden.size(0);
  const at::Tensor g = grad.defined() ? grad.to(ct) : at::zeros({rows}, hidden.options().dtype(ct));
  const at::Tensor ge = grad_entropy.defined() ? grad_entropy.to(ct) : at::Tensor();
  at::Tensor grad_h = need_h ? at::empty_like(hidden) : at::Tensor();
  at::Tensor grad_w;
  if (need_w && grad_w_into.defined()) {
    TILLER_CHECK(grad_w_into.scalar_type() == ct && grad_w_into.sizes() == weight.sizes() &&
                     grad_w_into.is_contiguous() && grad_w_into.device() == weight.device(),
                 "token_logprobs_backward: a weight gradient buffer of {} elements of {}, expected {} of {} "
                 "(the weight's shape, contiguous, on {})",
                 grad_w_into.numel(), c10::toString(grad_w_into.scalar_type()), weight.numel(), c10::toString(ct),
                 weight.device().str());
    grad_w = grad_w_into;
  } else if (need_w) {
    grad_w = at::zeros(weight.sizes(), weight.options().dtype(ct));
  }
  for (int64_t s = 0; s < rows; s += chunk) {
    const int64_t n = std::min(chunk, rows - s);
    at::Tensor h = hidden.narrow(0, s, n);
    at::Tensor z = at::matmul(h, weight.t());
    at::Tensor gs = g.narrow(0, s, n);
#ifdef TILLER_HAVE_CUDA_KERNELS
    if (fused(hidden, weight)) {
      // The logits become their gradient in place, in the weight dtype.
      z = z.contiguous();
      const at::Tensor tgt = targets.narrow(0, s, n).contiguous();
      const at::Tensor gsc = gs.to(at::kFloat).contiguous();
      const at::Tensor gec = ge.defined() ? ge.narrow(0, s, n).to(at::kFloat).contiguous() : at::Tensor();
      cuda::logprob_rows_backward(kernel_dtype(z.scalar_type()), z.data_ptr(), n, z.size(1), z.stride(0),
                                  tgt.data_ptr<int64_t>(), static_cast<float>(1.0 / temperature),
                                  gsc.data_ptr<float>(), gec.defined() ? gec.data_ptr<float>() : nullptr, stream_of(z));
      if (need_h) grad_h.narrow(0, s, n).copy_(at::matmul(z, weight));
      if (need_w) compat::addmm_accumulate(grad_w, z.t(), h);
      continue;
    }
#endif
    if (temperature != 1.0) z = z.to(ct) / temperature;
    at::Tensor dz;
    if (ge.defined()) {
      // -p * (g + ge * (log p + H)): the log-prob's and the entropy's gradient in one pass.
      at::Tensor logp = at::log_softmax(z, -1, ct);
      at::Tensor p = logp.exp();
      at::Tensor ent = -(p * logp).sum(-1, /*keepdim=*/true);
      at::Tensor ges = ge.narrow(0, s, n).unsqueeze(1);
      dz = logp.add_(ent).mul_(ges).add_(gs.unsqueeze(1)).mul_(p).neg_();
    } else {
      // softmax reads the weight-dtype logits and writes fp32: no separate fp32 copy of z.
      dz = at::softmax(z, -1, ct).mul_(-gs.unsqueeze(1));
    }
    dz.scatter_add_(1, targets.narrow(0, s, n).unsqueeze(1), gs.unsqueeze(1));
    if (temperature != 1.0) dz.div_(temperature);
    const at::Tensor dzw = dz.to(weight.scalar_type());
    if (need_h) grad_h.narrow(0, s, n).copy_(at::matmul(dzw, weight));
    if (need_w) compat::addmm_accumulate(grad_w, dzw.t(), h);
  }
  if (!need_w) return {grad_h, at::Tensor()};
  return {grad_h, fp32_w || grad_w_into.defined() ? grad_w : grad_w.to(weight.scalar_type())};
}

// Outputs: the log-probs, and the entropies when asked for. Both are differentiable; gradients
// that no loss reaches stay undefined (not materialised), so an unused entropy costs nothing.
struct ChunkedLogProbs : public torch::autograd::Function<ChunkedLogProbs> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& targets, double temperature, int64_t chunk, bool want_entropy) {
    const int64_t rows = hidden.size(0);
    at::Tensor out = at::empty({rows}, hidden.options().dtype(compute_type(hidden)));
    at::Tensor ent;
    if (want_entropy) ent = at::empty({rows}, out.options());
    for (int64_t s = 0; s < rows; s += chunk) {
      const int64_t n = std::min(chunk, rows - s);
      ChunkResult r = chunk_forward(hidden.narrow(0, s, n), weight, targets.narrow(0, s, n), temperature, want_entropy);
      out.narrow(0, s, n).copy_(r.logprobs);
      if (want_entropy) ent.narrow(0, s, n).copy_(r.entropy);
    }
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({hidden, weight, targets});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["chunk"] = chunk;
    if (want_entropy) return {out, ent};
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor none;
    const at::Tensor& g_ent = grads.size() > 1 ? grads[1] : none;
    auto [grad_h, grad_w] = backward_chunks(saved[0], saved[1], saved[2], grads[0], g_ent,
                                            ctx->saved_data["temperature"].toDouble(), ctx->saved_data["chunk"].toInt(),
                                            ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> token_logprobs_backward(const at::Tensor& hidden, const at::Tensor& lm_head,
                                                          const at::Tensor& targets, const at::Tensor& grad,
                                                          double temperature, int64_t chunk_rows, bool need_hidden,
                                                          bool need_weight, bool fp32_weight_grad,
                                                          const at::Tensor& grad_entropy,
                                                          const at::Tensor& weight_grad_into) {
  for (const at::Tensor* t : {&grad, &grad_entropy})
    TILLER_CHECK(!t->defined() || (t->dim() == 1 && t->size(0) == hidden.size(0)),
                 "token_logprobs_backward: {} gradients for {} rows", t->numel(), hidden.size(0));
  return backward_chunks(hidden, lm_head, targets.to(at::kLong), grad, grad_entropy, temperature, chunk_rows,
                         need_hidden, need_weight, fp32_weight_grad, weight_grad_into);
}

at::Tensor token_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& targets,
                          double temperature, int64_t chunk_rows, at::Tensor* entropy) {
  TILLER_CHECK(hidden.dim() == 2 && lm_head.dim() == 2 && hidden.size(1) == lm_head.size(1),
               "token_logprobs: hidden [T, H] and lm_head [V, H] expected");
  TILLER_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "token_logprobs: {} targets for {} rows",
               targets.numel(), hidden.size(0));
  TILLER_CHECK(temperature > 0, "temperature must be > 0, got {}", temperature);
  TILLER_CHECK(chunk_rows > 0, "chunk_rows must be > 0");
  variable_list out = ChunkedLogProbs::apply(hidden, lm_head, targets.to(at::kLong), temperature, chunk_rows,
                                             entropy != nullptr);
  if (entropy) *entropy = out[1];
  return out[0];
}

}  // namespace tiller::model
