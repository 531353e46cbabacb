#include "model/batch_invariant.h"

#include <atomic>
#include <cmath>
#include <limits>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "model/host_upload.h"
#include "tiller/core/error.h"
#include "tiller/model/numerics.h"

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "model/batch_invariant_cuda.h"
#include "model/cuda/aten_dtype.h"
#include "model/cuda/paged_attention.h"
#endif

namespace tiller::model {
namespace {
std::atomic<Numerics> g_numerics{Numerics::kDefault};
}  // namespace

void set_numerics(Numerics n) { g_numerics.store(n, std::memory_order_relaxed); }
Numerics numerics() { return g_numerics.load(std::memory_order_relaxed); }

namespace invariant {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// fp64 inputs accumulate in fp64 (gradient checks), everything else in fp32.
at::ScalarType acc_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// The one reduction order: element k into lane k % 8, lanes added pairwise.
template <typename A>
inline A lanes_sum(const A (&l)[8]) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// b may be stored in a narrower type (bf16, fp16): each element is widened to A exactly.
template <typename A, typename B>
A dot(const A* a, const B* b, int64_t n) {
  A l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) l[j] += a[k + j] * static_cast<A>(b[k + j]);
  for (int j = 0; k < n; ++k, ++j) l[j] += a[k] * static_cast<A>(b[k]);
  return lanes_sum(l);
}

// [M, K] contiguous in the accumulation type (an exact conversion).
at::Tensor acc_rows(const at::Tensor& x, int64_t k, at::ScalarType acc) {
  return x.reshape({-1, k}).to(acc).contiguous();
}

#define TILLER_DISPATCH_INVARIANT(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  check_device(x, "a matmul's input");
  check_device(w, "a matmul's weight");
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (x.is_cuda()) {
    TILLER_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "linear: input [..., {}] against a weight of {} columns",
                 x.size(-1), w.dim() == 2 ? w.size(1) : -1);
    return linear_cuda(x, w, b);
  }
#endif
  TILLER_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "linear: input [..., {}] against a weight of {} columns",
               x.size(-1), w.dim() == 2 ? w.size(1) : -1);
  const int64_t k = w.size(1), n = w.size(0);
  const at::ScalarType acc = acc_type(x);
  // The activations in the accumulation type (an exact conversion); the weight read in place in
  // x's dtype (converted element by element, exactly: no [N, K] fp32 copy per call).
  const at::Tensor xa = acc_rows(x, k, acc), wc = w.to(x.scalar_type()).contiguous();
  const at::Tensor ba = b.defined() ? b.to(acc).contiguous() : at::Tensor();
  const int64_t m = xa.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return out.view(shape);
  TILLER_DISPATCH_INVARIANT(x.scalar_type(), "invariant_linear", [&] {
    using A = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const A* xp = xa.data_ptr<A>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    const A* bp = ba.defined() ? ba.data_ptr<A>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    // Work items are (row, 64-column tile); every output is one dot() whoever computes it.
    constexpr int64_t kTile = 64;
    const int64_t tiles = (n + kTile - 1) / kTile;
    at::parallel_for(0, m * tiles, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, k)), [&](int64_t lo, int64_t hi) {
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t r = item / tiles, c0 = (item % tiles) * kTile, c1 = std::min(n, c0 + kTile);
        const A* xr = xp + r * k;
        for (int64_t c = c0; c < c1; ++c) {
          A v = dot(xr, wp + c * k, k);
          if (bp) v += bp[c];
          op[r * n + c] = static_cast<scalar_t>(v);
        }
      }
    });
  });
  return out.view(shape);
}

// Bias or not: autograd functions take defined tensors only, so the bias-free form is its own node.
template <bool kBias>
struct LinearNode : public torch::autograd::Function<LinearNode<kBias>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    ctx->save_for_backward({x, w});
    if constexpr (kBias) ctx->saved_data["bias_dtype"] = static_cast<int64_t>(b.scalar_type());
    return linear_forward(x, w, kBias ? b : at::Tensor());
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return linear_forward(x, w, at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor g = grads[0].reshape({-1, w.size(0)});
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = at::matmul(g, w.to(g.scalar_type())).view(x.sizes()).to(x.scalar_type());
    if (ctx->needs_input_grad(1))
      gw = at::matmul(g.t(), x.reshape({-1, w.size(1)}).to(g.scalar_type())).to(w.scalar_type());
    if constexpr (kBias) {
      if (ctx->needs_input_grad(2))
        gb = g.sum(0).to(static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
      return {gx, gw, gb};
    }
    return {gx, gw};
  }
};

at::Tensor rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_device(x, "RMSNorm's input");
  const int64_t d = x.size(-1);
  TILLER_CHECK(weight.dim() == 1 && weight.size(0) == d, "rms_norm: a weight of {} for rows of {}", weight.numel(), d);
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (x.is_cuda()) return rms_norm_cuda(x, weight, eps);
#endif
  const at::ScalarType acc = acc_type(x);
  const at::Tensor xa = acc_rows(x, d, acc), wa = weight.to(acc).contiguous();
  const int64_t rows = xa.size(0);
  at::Tensor out = at::empty({rows, d}, x.options().memory_format(at::MemoryFormat::Contiguous));
  TILLER_DISPATCH_INVARIANT(x.scalar_type(), "invariant_rms_norm", [&] {
    using A = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const A* xp = xa.data_ptr<A>();
    const A* wp = wa.data_ptr<A>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const A e = static_cast<A>(eps);
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const A* xr = xp + r * d;
        const A inv = A(1) / std::sqrt(dot(xr, xr, d) / static_cast<A>(d) + e);
        for (int64_t j = 0; j < d; ++j) op[r * d + j] = static_cast<scalar_t>(xr[j] * inv * wp[j]);
      }
    });
  });
  return out.view(x.sizes());
}

// The gradient of `fn` at (x, w) from its ordinary ATen formula, recomputed under autograd.
variable_list ordinary_grads(const at::Tensor& out, const std::vector<at::Tensor>& inputs, const at::Tensor& grad) {
  std::vector<at::Tensor> want;
  for (const auto& t : inputs)
    if (t.requires_grad()) want.push_back(t);
  if (want.empty()) return {};
  return torch::autograd::grad({out}, want, {grad}, /*retain_graph=*/false, /*create_graph=*/false,
                               /*allow_unused=*/true);
}

struct RmsNormNode : public torch::autograd::Function<RmsNormNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["eps"] = eps;
    return rms_norm_forward(x, w, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor x = saved[0].detach().requires_grad_(ctx->needs_input_grad(0));
    at::Tensor w = saved[1].detach().requires_grad_(ctx->needs_input_grad(1));
    at::Tensor y;
    {
      at::AutoGradMode on(true);
      y = at::rms_norm(x, {x.size(-1)}, w, ctx->saved_data["eps"].toDouble());
    }
    const variable_list g = ordinary_grads(y, {x, w}, grads[0]);
    size_t i = 0;
    at::Tensor gx = x.requires_grad() ? g[i++] : at::Tensor();
    at::Tensor gw = w.requires_grad() ? g[i++] : at::Tensor();
    return {gx, gw, at::Tensor()};
  }
};

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  check_device(gate, "SwiGLU's input");
  TILLER_CHECK(gate.sizes() == up.sizes(), "swiglu: gate and up shapes differ");
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (gate.is_cuda()) {  // an elementwise kernel: invariant as it is (one for the packed and the split forms)
    const int64_t width = gate.size(-1);
    at::Tensor g = gate.reshape({-1, width}), u = up.reshape({-1, width}).to(gate.scalar_type());
    if (g.stride(1) != 1) g = g.contiguous();
    if (u.stride(1) != 1) u = u.contiguous();
    at::Tensor out = at::empty(g.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
    cuda::swiglu(cuda::kernel_dtype(gate.scalar_type()), g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0),
                 out.data_ptr(), g.size(0), width, stream_of(gate));
    return out.view(gate.sizes());
  }
#endif
  const at::ScalarType acc = acc_type(gate);
  const at::Tensor ga = gate.to(acc).contiguous(), ua = up.to(acc).contiguous();
  at::Tensor out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = out.numel();
  TILLER_DISPATCH_INVARIANT(gate.scalar_type(), "invariant_swiglu", [&] {
    using A = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const A* gp = ga.data_ptr<A>();
    const A* up_ = ua.data_ptr<A>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) op[i] = static_cast<scalar_t>(gp[i] / (A(1) + std::exp(-gp[i])) * up_[i]);
    });
  });
  return out;
}

at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_device(x, "RoPE's input");
  TILLER_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                   sin.sizes() == cos.sizes() && x.size(2) % 2 == 0,
               "rope: x [T, H, D] and tables [T, D] expected");
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (x.is_cuda()) {  // an elementwise kernel: invariant as it is
    const at::Tensor xc = x.stride(2) == 1 ? x : x.contiguous();
    const at::Tensor c = cos.to(x.scalar_type()).contiguous(), sn = sin.to(x.scalar_type()).contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    cuda::rope(cuda::kernel_dtype(x.scalar_type()), xc.data_ptr(), c.data_ptr(), sn.data_ptr(), out.data_ptr(),
               x.size(0), x.size(1), x.size(2), xc.stride(0), xc.stride(1), /*backward=*/false, stream_of(x));
    return out;
  }
#endif
  const at::ScalarType acc = acc_type(x);
  const at::Tensor xa = x.to(acc).contiguous();
  const at::Tensor ca = cos.to(x.scalar_type()).to(acc).contiguous(), sa = sin.to(x.scalar_type()).to(acc).contiguous();
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2;
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  TILLER_DISPATCH_INVARIANT(x.scalar_type(), "invariant_rope", [&] {
    using A = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const A* xp = xa.data_ptr<A>();
    const A* cp = ca.data_ptr<A>();
    const A* sp = sa.data_ptr<A>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t * h, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)), [&](int64_t lo, int64_t hi) {
      for (int64_t row = lo; row < hi; ++row) {
        const A* xr = xp + row * d;
        const A* c = cp + (row / h) * d;
        const A* s = sp + (row / h) * d;
        for (int64_t j = 0; j < d; ++j) {
          const A rot = j < half ? -xr[j + half] : xr[j - half];
          const A a = xr[j] * c[j], b = rot * s[j];
          op[row * d + j] = static_cast<scalar_t>(a + b);
        }
      }
    });
  });
  return out;
}

namespace {

at::Tensor softmax_forward(const at::Tensor& x) {
  check_device(x, "a router's softmax input");
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (x.is_cuda()) return softmax_cuda(x);
#endif
  const int64_t c = x.size(-1);
  const at::ScalarType acc = acc_type(x);
  const at::Tensor xa = acc_rows(x, c, acc);
  const int64_t rows = xa.size(0);
  at::Tensor out = at::empty({rows, c}, xa.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "invariant_softmax", [&] {
    using A = scalar_t;
    const A* xp = xa.data_ptr<A>();
    A* op = out.data_ptr<A>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, c)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const A* xr = xp + r * c;
        A mx = -std::numeric_limits<A>::infinity();
        for (int64_t j = 0; j < c; ++j) mx = std::max(mx, xr[j]);
        A l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = 0; j < c; ++j) {
          op[r * c + j] = std::exp(xr[j] - mx);
          l[j % 8] += op[r * c + j];
        }
        const A sum = lanes_sum(l);
        for (int64_t j = 0; j < c; ++j) op[r * c + j] /= sum;
      }
    });
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  return out.view(shape);
}

// d x = p * (g - sum(g * p)), the ordinary formula.
struct SoftmaxNode : public torch::autograd::Function<SoftmaxNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::Tensor p = softmax_forward(x);
    ctx->save_for_backward({p});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return p;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor p = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].to(p.scalar_type());
    const at::Tensor gx = p * (g - (g * p).sum(-1, true));
    return {gx.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()))};
  }
};

}  // namespace

void check_device(const at::Tensor& t, const char* what) {
  if (t.is_cpu()) return;
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType type = t.scalar_type();
  if (t.is_cuda() && (type == at::kBFloat16 || type == at::kHalf || type == at::kFloat)) return;
  throw Error(fmt::format("algo.logprob_match = bitwise: {} is a {} tensor on {}; the batch-invariant kernels take CPU "
                          "tensors and CUDA tensors of bf16, fp16 or fp32",
                          what, c10::toString(type), t.device().str()));
#else
  throw Error(fmt::format("algo.logprob_match = bitwise: {} is on {}, and this build of tiller has no CUDA kernels; "
                          "build it with CUDA or set algo.logprob_match: off",
                          what, t.device().str()));
#endif
}
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? LinearNode<true>::apply(x, w, b) : LinearNode<false>::apply(x, w);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormNode::apply(x, weight, eps);
}


at::Tensor softmax(const at::Tensor& x) { return SoftmaxNode::apply(x); }

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& add, const at::Tensor& weight, double eps) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  const at::ScalarType t = x.scalar_type();
  if (x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 && add.stride(1) == 1 && add.scalar_type() == t &&
      (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat)) {
    const at::Tensor w = weight.to(t).contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    cuda::invariant_add_rms_norm(cuda::kernel_dtype(t), x.data_ptr(), add.data_ptr(), w.data_ptr(), out.data_ptr(),
                                 x.size(0), x.size(1), x.stride(0), add.stride(0), static_cast<float>(eps),
                                 stream_of(x));
    return out;
  }
#endif
  x.add_(add);
  return rms_norm(x, weight, eps);
}


at::Tensor attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& s,
                             double scale) {
  check_device(q, "attention's query");
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (q.is_cuda()) return attention_cuda(q, k, v, s, scale);
#endif
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  const int64_t groups = heads / kv_heads;
  const at::ScalarType acc = acc_type(q);
  const at::Tensor qa = q.to(acc).contiguous(), ka = k.to(acc).contiguous(), va = v.to(acc).contiguous();
  at::Tensor out = at::zeros(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  // Each query row: its sequence, its offset into k, and its key range.
  const int64_t tq = q.size(0);
  std::vector<int64_t> key_base(static_cast<size_t>(tq)), key_lo(static_cast<size_t>(tq)), key_hi(static_cast<size_t>(tq));
  int64_t sq = 0, sk = 0;
  for (size_t i = 0; i < s.lens_q.size(); ++i) {
    const int64_t lq = s.lens_q[i], lk = s.lens_k[i];
    TILLER_CHECK(lq <= lk, "attention: sequence {} has {} queries for {} keys", i, lq, lk);
    for (int64_t r = 0; r < lq; ++r) {
      const int64_t pos = r + lk - lq;  // the query's key position
      key_base[static_cast<size_t>(sq + r)] = sk;
      key_lo[static_cast<size_t>(sq + r)] = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
      key_hi[static_cast<size_t>(sq + r)] = pos + 1;
    }
    sq += lq;
    sk += lk;
  }
  TILLER_CHECK(sq == tq && sk == k.size(0), "varlen attention: lengths cover {} of {} queries and {} of {} keys", sq, tq,
               sk, k.size(0));
  TILLER_DISPATCH_INVARIANT(q.scalar_type(), "invariant_attention", [&] {
    using A = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const A* qp = qa.data_ptr<A>();
    const A* kp = ka.data_ptr<A>();
    const A* vp = va.data_ptr<A>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const A sc = static_cast<A>(scale);
    at::parallel_for(0, tq * heads, 1, [&](int64_t lo, int64_t hi) {
      std::vector<A> p, o(static_cast<size_t>(d));
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t r = item / heads, h = item % heads, kh = h / groups;
        const auto ri = static_cast<size_t>(r);
        const int64_t base = key_base[ri], k0 = key_lo[ri], k1 = key_hi[ri];
        const A* qr = qp + (r * heads + h) * d;
        p.resize(static_cast<size_t>(k1 - k0));
        A mx = -std::numeric_limits<A>::infinity();
        for (int64_t j = k0; j < k1; ++j) {
          const A sj = dot(qr, kp + ((base + j) * kv_heads + kh) * d, d) * sc;
          p[static_cast<size_t>(j - k0)] = sj;
          mx = std::max(mx, sj);
        }
        A l = 0;
        std::fill(o.begin(), o.end(), A(0));
        for (int64_t j = k0; j < k1; ++j) {
          const A e = std::exp(p[static_cast<size_t>(j - k0)] - mx);
          l += e;
          const A* vr = vp + ((base + j) * kv_heads + kh) * d;
          for (int64_t c = 0; c < d; ++c) o[static_cast<size_t>(c)] += e * vr[c];
        }
        scalar_t* orow = op + (r * heads + h) * d;
        for (int64_t c = 0; c < d; ++c) orow[c] = static_cast<scalar_t>(l > 0 ? o[static_cast<size_t>(c)] / l : A(0));
      }
    });
  });
  return out;
}

at::Tensor logprobs(const at::Tensor& logits, const at::Tensor& targets, const std::vector<float>& temperatures,
                    at::Tensor* entropy) {
  check_device(logits, "the log-prob head's logits");
  TILLER_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
               "logprobs: [R, vocab] logits and [R] targets expected");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TILLER_CHECK(temperatures.size() == 1 || static_cast<int64_t>(temperatures.size()) == rows,
               "logprobs: {} temperatures for {} rows", temperatures.size(), rows);
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (logits.is_cuda()) return logprobs_cuda(logits, targets, temperatures, entropy);
#endif
  const at::ScalarType acc = acc_type(logits);
  const at::Tensor za = logits.to(acc).contiguous();
  const at::Tensor tgt = targets.to(at::kLong).contiguous();
  at::Tensor out = at::empty({rows}, logits.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "invariant_logprobs", [&] {
    using A = scalar_t;
    const A* zp = za.data_ptr<A>();
    const int64_t* tp = tgt.data_ptr<int64_t>();
    A* op = out.data_ptr<A>();
    at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
      std::vector<A> z(static_cast<size_t>(vocab));
      for (int64_t r = lo; r < hi; ++r) {
        const A t = static_cast<A>(temperatures.size() == 1 ? temperatures[0] : temperatures[static_cast<size_t>(r)]);
        TILLER_CHECK(t > 0, "logprobs: temperature {} of row {} is not > 0", t, r);
        TILLER_CHECK(tp[r] >= 0 && tp[r] < vocab, "logprobs: target {} of row {} outside the vocabulary of {}", tp[r],
                     r, vocab);
        A mx = -std::numeric_limits<A>::infinity();
        for (int64_t j = 0; j < vocab; ++j) {
          z[static_cast<size_t>(j)] = zp[r * vocab + j] / t;
          mx = std::max(mx, z[static_cast<size_t>(j)]);
        }
        A l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = 0; j < vocab; ++j) l[j % 8] += std::exp(z[static_cast<size_t>(j)] - mx);
        op[r] = (z[static_cast<size_t>(tp[r])] - mx) - std::log(lanes_sum(l));
      }
    });
  });
  if (entropy) {  // the ordinary formula (the entropy need not be invariant)
    const at::Tensor t = temperatures.size() == 1
                             ? at::full({1, 1}, temperatures[0], za.options())
                             : at::tensor(temperatures, at::kFloat).to(za.scalar_type()).unsqueeze(1);
    const at::Tensor logp = at::log_softmax(za / t, -1);
    *entropy = -(logp.exp() * logp).sum(-1);
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& freqs, double scaling) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  // On the GPU, where the engine's table and the trainer's come from alike: no copy to the host
  // and back, which synchronised every forward with the device and took ~15 ms of host work at
  // 8k tokens (0.5B scoring on H200: 14.6 ms of a 37.6 ms step idle).
  if (freqs.is_cuda()) return rope_tables_cuda(freqs, scaling);
#endif
  const at::Tensor f = freqs.to(at::kCPU, at::kFloat).contiguous();
  at::Tensor c = at::empty(f.sizes(), f.options()), s = at::empty(f.sizes(), f.options());
  const float* fp = f.data_ptr<float>();
  float* cp = c.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  const auto sc = static_cast<float>(scaling);
  for (int64_t i = 0; i < f.numel(); ++i) {
    cp[i] = std::cos(fp[i]);
    sp[i] = std::sin(fp[i]);
    if (scaling != 1.0) {
      cp[i] *= sc;
      sp[i] *= sc;
    }
  }
  return {c.to(freqs.device()), s.to(freqs.device())};
}

}  // namespace invariant
}  // namespace tiller::model
