// The CUDA forms of the batch-invariant operations (batch_invariant_cuda.h).
#include "model/batch_invariant_cuda.h"

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>

#include "model/cuda/aten_dtype.h"
#include "model/cuda/paged_attention.h"
#include "model/host_upload.h"
#include "tiller/core/error.h"

namespace tiller::model::invariant {
namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const int64_t k = w.size(1), n = w.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  if (n == 1) {  // a value head: one dot product a row (cuBLASLt's kernels for one column are not probed)
    const at::Tensor wc = w.to(x.scalar_type()).contiguous();
    const at::Tensor bc = b.defined() ? b.to(x.scalar_type()).contiguous() : at::Tensor();
    at::Tensor x2 = x.reshape({-1, k});
    if (x2.stride(1) != 1) x2 = x2.contiguous();
    at::Tensor out = at::empty({x2.size(0)}, x.options().memory_format(at::MemoryFormat::Contiguous));
    cuda::invariant_row_dot(cuda::kernel_dtype(x.scalar_type()), x2.data_ptr(), x2.stride(0), wc.data_ptr(),
                            bc.defined() ? bc.data_ptr() : nullptr, out.data_ptr(), x2.size(0), k, stream_of(x));
    return out.view(shape);
  }
  TILLER_CHECK(k * x.element_size() % 16 == 0,
               "algo.logprob_match = bitwise: a matmul over {} inputs ({} bytes a row) needs rows of a multiple of 16 "
               "bytes on CUDA",
               k, k * x.element_size());
  at::Tensor wc = w.to(x.scalar_type()).contiguous();
  if (!aligned16(wc)) wc = wc.clone();
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1 || x2.stride(0) < k || x2.stride(0) * x2.element_size() % 16 != 0) x2 = x2.contiguous();
  if (!aligned16(x2)) x2 = x2.clone(at::MemoryFormat::Contiguous);
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto dtype = cuda::kernel_dtype(x.scalar_type());
  const int device = x.device().index();
  void* stream = stream_of(x);
  const size_t ws = cuda::invariant_gemm_workspace(dtype, m, n, k, x2.stride(0), device, stream);
  const at::Tensor work = ws ? at::empty({static_cast<int64_t>(ws)}, x.options().dtype(at::kByte)) : at::Tensor();
  try {
    cuda::invariant_gemm(dtype, x2.data_ptr(), x2.stride(0), wc.data_ptr(), out.data_ptr(), m, n, k,
                         ws ? work.data_ptr() : nullptr, ws, device, stream);
  } catch (const std::exception& e) {
    throw Error(e.what());
  }
  if (b.defined()) out.add_(b.to(x.scalar_type()));
  return out.view(shape);
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t d = x.size(-1);
  const at::Tensor xc = x.contiguous(), wc = weight.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  cuda::invariant_rms_norm(cuda::kernel_dtype(x.scalar_type()), xc.data_ptr(), wc.data_ptr(), out.data_ptr(),
                           d ? x.numel() / d : 0, d, static_cast<float>(eps), stream_of(x));
  return out;
}

at::Tensor softmax_cuda(const at::Tensor& x) {
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t c = x.size(-1);
  cuda::invariant_softmax(xc.data_ptr<float>(), out.data_ptr<float>(), c ? xc.numel() / c : 0, c, stream_of(x));
  return out;
}

std::pair<at::Tensor, at::Tensor> rope_tables_cuda(const at::Tensor& freqs, double scaling) {
  const at::Tensor f = freqs.to(at::kFloat).contiguous();
  at::Tensor c = at::empty(f.sizes(), f.options()), s = at::empty(f.sizes(), f.options());
  cuda::invariant_rope_tables(f.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), f.numel(),
                              static_cast<float>(scaling), scaling != 1.0, stream_of(freqs));
  return {c, s};
}

at::Tensor attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& s,
                          double scale) {
  const int64_t tq = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TILLER_CHECK(cuda::paged_decode_supports(d),
               "algo.logprob_match = bitwise: head size {} has no decode attention kernel on CUDA (16, 32, 64, 128, "
               "256 do)",
               d);
  TILLER_CHECK(k.size(0) < (int64_t{1} << 31) && tq < (int64_t{1} << 31),
               "attention: {} queries and {} keys exceed the kernel's int32 rows", tq, k.size(0));
  const auto dtype = cuda::kernel_dtype(q.scalar_type());
  // The tensor-core prefill form (16 query tokens of a sequence a tile, paged_attention.h's
  // PrefillRows: `blocks`), or each query as a decode step (`words`: keys per query, then its
  // sequence's first key).
  const bool tiles = s.window == 0 && cuda::paged_decode_prefill_serves(dtype, d, heads, kv_heads);
  std::vector<int32_t> blocks, words(tiles ? 0 : static_cast<size_t>(2 * tq));
  int64_t sq = 0, sk = 0;
  for (size_t i = 0; i < s.lens_q.size(); ++i) {
    const int64_t lq = s.lens_q[i], lk = s.lens_k[i];
    TILLER_CHECK(lq <= lk, "attention: sequence {} has {} queries for {} keys", i, lq, lk);
    TILLER_CHECK(sq + lq <= tq, "varlen attention: lengths cover more than {} queries", tq);
    if (tiles) {
      for (int64_t r0 = 0; r0 < lq; r0 += 16)
        blocks.insert(blocks.end(), {static_cast<int32_t>(sq + r0), static_cast<int32_t>(std::min<int64_t>(16, lq - r0)),
                                     static_cast<int32_t>(sk), static_cast<int32_t>(r0 + lk - lq)});
    } else {
      for (int64_t r = 0; r < lq; ++r) {
        words[static_cast<size_t>(sq + r)] = static_cast<int32_t>(r + lk - lq + 1);
        words[static_cast<size_t>(tq + sq + r)] = static_cast<int32_t>(sk);
      }
    }
    sq += lq;
    sk += lk;
  }
  TILLER_CHECK(sq == tq && sk == k.size(0), "varlen attention: lengths cover {} of {} queries and {} of {} keys", sq, tq,
               sk, k.size(0));
  at::Tensor out = at::empty({tq, heads, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (tq == 0) return out;
  at::Tensor qc = q;
  if (!(q.stride(2) == 1 && q.stride(1) == d && q.stride(0) * q.element_size() % 16 == 0)) qc = q.contiguous();
  if (!aligned16(qc)) qc = qc.clone(at::MemoryFormat::Contiguous);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  if (tiles) {
    const at::Tensor dev = upload(blocks, q.device());
    cuda::PrefillRows a;
    a.dtype = dtype;
    a.q = qc.data_ptr();
    a.q_token_stride = qc.stride(0);
    a.k = kc.data_ptr();
    a.v = vc.data_ptr();
    a.out = out.data_ptr();
    a.blocks = dev.data_ptr<int32_t>();
    a.count = static_cast<int64_t>(blocks.size() / 4);
    a.heads = heads;
    a.kv_heads = kv_heads;
    a.head_dim = d;
    a.scale = static_cast<float>(scale);
    try {
      cuda::paged_decode_prefill(a, stream_of(q));
    } catch (const std::exception& e) {
      throw Error(fmt::format("attention (algo.logprob_match = bitwise): {}", e.what()));
    }
    return out;
  }
  const at::Tensor dev = upload(words, q.device());
  cuda::PagedDecode a;
  a.dtype = dtype;
  a.q_token_stride = qc.stride(0);
  a.k_cache = const_cast<void*>(kc.data_ptr());
  a.v_cache = const_cast<void*>(vc.data_ptr());
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = d;
  a.block_size = 1;
  a.window = s.window;
  a.scale = static_cast<float>(scale);
  a.splits = 1;
  const int64_t es = q.element_size();
  constexpr int64_t kRowsPerLaunch = 65535;  // the grid's y limit
  try {
    for (int64_t r0 = 0; r0 < tq; r0 += kRowsPerLaunch) {
      a.batch = std::min(kRowsPerLaunch, tq - r0);
      a.q = static_cast<const char*>(qc.data_ptr()) + r0 * qc.stride(0) * es;
      a.out = static_cast<char*>(out.data_ptr()) + r0 * heads * d * es;
      a.seq_lens = dev.data_ptr<int32_t>() + r0;
      a.key_base = dev.data_ptr<int32_t>() + tq + r0;
      cuda::paged_decode_attention(a, stream_of(q));
    }
  } catch (const std::exception& e) {
    throw Error(fmt::format("attention (algo.logprob_match = bitwise): {}", e.what()));
  }
  return out;
}

at::Tensor logprobs_cuda(const at::Tensor& logits, const at::Tensor& targets, const std::vector<float>& temperatures,
                         at::Tensor* entropy) {
  for (size_t i = 0; i < temperatures.size(); ++i)
    TILLER_CHECK(temperatures[i] > 0, "logprobs: temperature {} of row {} is not > 0", temperatures[i], i);
  const at::Tensor z = logits.stride(1) == 1 ? logits : logits.contiguous();
  const at::Tensor tgt = targets.to(logits.device(), at::kLong).contiguous();
  const at::Tensor temps = upload(temperatures, logits.device());
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  if (entropy) *entropy = at::empty_like(out);
  cuda::invariant_logprobs(cuda::kernel_dtype(z.scalar_type()), z.data_ptr(), z.size(0), z.size(1), z.stride(0),
                           tgt.data_ptr<int64_t>(), temps.data_ptr<float>(), temperatures.size() > 1,
                           out.data_ptr<float>(), entropy ? entropy->data_ptr<float>() : nullptr, stream_of(logits));
  return out;
}

}  // namespace tiller::model::invariant
