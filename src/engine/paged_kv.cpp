// The engine's view of its paged KV cache for one step (paged_kv.h).
#include "engine/paged_kv.h"

#include <ATen/ATen.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/aten_dtype.h"
#include "model/cuda/paged_attention.h"
#endif

#include "tiller/core/error.h"
#include "tiller/model/fp8.h"

namespace tiller::engine {

#ifdef TILLER_HAVE_CUDA_KERNELS
namespace cuda = model::cuda;  // the kernels (src/model/cuda/)
#endif

void fill_decode_words(const StepBatch& b, int64_t rows, int64_t bs, std::vector<int32_t>& w) {
  const int64_t n = b.num_seqs();
  w.assign(static_cast<size_t>(5 * rows), 0);
  for (int64_t i = 0; i < rows; ++i) w[2 * rows + i] = -1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lk = b.lens_k[i], used = (lk + bs - 1) / bs;
    TILLER_CHECK(b.lens_q[i] == 1 && lk >= 1 && static_cast<int64_t>(b.tables[i].size()) >= used,
                 "decode batch: sequence {} has {} new of {} tokens in {} blocks", i, b.lens_q[i], lk,
                 b.tables[i].size());
    w[i] = static_cast<int32_t>(b.tokens[i]);
    w[rows + i] = static_cast<int32_t>(b.positions[i]);
    w[2 * rows + i] = static_cast<int32_t>(b.tables[i][(lk - 1) / bs] * bs + (lk - 1) % bs);
    w[3 * rows + i] = static_cast<int32_t>(lk);
    w[4 * rows + i] = static_cast<int32_t>(w.size() - static_cast<size_t>(5 * rows));
    for (int64_t j = 0; j < used; ++j) w.push_back(static_cast<int32_t>(b.tables[i][j]));
  }
}

DecodeInputs decode_views(const at::Tensor& dev, int64_t rows, int64_t batch) {
  DecodeInputs in;
  in.tokens = dev.narrow(0, 0, batch);
  in.positions = dev.narrow(0, rows, batch);
  in.slots = dev.narrow(0, 2 * rows, batch);
  in.seq_lens = dev.narrow(0, 3 * rows, batch);
  in.offsets = dev.narrow(0, 4 * rows, batch);
  in.blocks = dev.narrow(0, 5 * rows, dev.size(0) - 5 * rows);
  return in;
}

at::Tensor PagedKv::attend_fp8(int64_t layer, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const model::VarlenSpec& spec, double scale,
                               model::AttentionBackend backend) {
  namespace fp8 = model::fp8;
  const at::ScalarType dtype = q.scalar_type();
  const at::Tensor ks = scales_[layer][0], vs = scales_[layer][1];
  const fp8::GroupQuantized kq = fp8::quantize_rows(k), vq = fp8::quantize_rows(v);
  kc.view(at::kByte).index_copy_(0, slots_, kq.q.view(at::kByte));
  vc.view(at::kByte).index_copy_(0, slots_, vq.q.view(at::kByte));
  ks.index_copy_(0, slots_, kq.scale);
  vs.index_copy_(0, slots_, vq.scale);
  if (!gather_.defined())
    return model::varlen_attention(q, fp8::dequantize_rows(kq, dtype), fp8::dequantize_rows(vq, dtype), spec, scale,
                                   backend);
  auto gathered = [&](const at::Tensor& c, const at::Tensor& s) {
    return fp8::dequantize_rows({c.view(at::kByte).index_select(0, gather_).view(at::kFloat8_e4m3fn),
                                 s.index_select(0, gather_)},
                                dtype);
  };
  return model::varlen_attention(q, gathered(kc, ks), gathered(vc, vs), spec, scale, backend);
}

#ifdef TILLER_HAVE_CUDA_KERNELS
using model::cuda::kernel_dtype;

namespace {

// [T, heads, head_dim] with head stride head_dim, unit element stride, and (for the 16-byte loads
// of the decode kernel) an aligned start and token stride.
at::Tensor rows_layout(const at::Tensor& x, bool aligned) {
  const bool ok = x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  (!aligned || (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0));
  return ok ? x : x.clone(at::MemoryFormat::Contiguous);
}

}  // namespace

at::Tensor PagedKv::attend_decode(int64_t layer, const at::Tensor& kc, const at::Tensor& vc, at::Tensor q,
                                  at::Tensor k, at::Tensor v, const model::VarlenSpec& spec, double scale) {
  const DecodeInputs& in = *decode_;
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  const auto dtype = kernel_dtype(q.scalar_type());
  void* stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const bool fp8 = scales_.defined();
  k = rows_layout(k, true);
  v = rows_layout(v, true);
  q = rows_layout(q, true);
  at::Tensor out = at::empty({batch, heads, dim}, q.options());
  at::Tensor workspace;
  const int64_t ws = cuda::paged_decode_workspace_floats(batch, heads, dim, in.splits);
  if (ws > 0) workspace = at::empty({ws}, q.options().dtype(at::kFloat));
  cuda::PagedDecode a;
  a.dtype = dtype;
  a.q = q.data_ptr();
  a.q_token_stride = q.stride(0);
  a.k_cache = kc.data_ptr();
  a.v_cache = vc.data_ptr();
  a.out = out.data_ptr();
  a.seq_lens = in.seq_lens.data_ptr<int32_t>();
  a.offsets = in.offsets.data_ptr<int32_t>();
  a.blocks = in.blocks.data_ptr<int32_t>();
  a.batch = batch;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = dim;
  a.block_size = block_size_;
  a.window = spec.window;
  a.scale = static_cast<float>(scale);
  a.splits = in.splits;
  a.pack_keys = in.pack_keys;
  a.workspace = ws > 0 ? workspace.data_ptr<float>() : nullptr;
  a.slots = in.slots.data_ptr<int32_t>();
  if (fp8) {  // this step's rows quantized into the cache first; the kernel reads them from there
    TILLER_CHECK(!cos_.defined(), "decode attention: an FP8 KV cache takes keys already rotated");
    at::Tensor ks = scales_[layer][0], vs = scales_[layer][1];
    cuda::write_kv_fp8(dtype, k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kc.data_ptr(), vc.data_ptr(),
                       ks.data_ptr<float>(), vs.data_ptr<float>(), a.slots, batch, kv_heads, dim, stream);
    a.cache_fp8 = true;
    a.k_scale = ks.data_ptr<float>();
    a.v_scale = vs.data_ptr<float>();
    cuda::paged_decode_attention(a, stream);
    return out;
  }
  a.k_new = k.data_ptr();  // the kernel stores this step's K/V into the cache
  a.v_new = v.data_ptr();
  a.k_new_stride = k.stride(0);
  a.v_new_stride = v.stride(0);
  if (cos_.defined()) {
    auto table_ok = [&](const at::Tensor& t) {
      return t.is_contiguous() && t.scalar_type() == q.scalar_type() && t.dim() == 2 && t.size(0) == batch &&
             t.size(1) == dim && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    };
    TILLER_CHECK(table_ok(cos_) && table_ok(sin_),
                 "decode attention: RoPE tables of {} elements for {} rows of head size {} (want contiguous, "
                 "16-byte aligned [rows, head_dim] in q's dtype)",
                 cos_.numel(), batch, dim);
    a.rope_cos = cos_.data_ptr();
    a.rope_sin = sin_.data_ptr();
  }
  cuda::paged_decode_attention(a, stream);
  return out;
}
#else
at::Tensor PagedKv::attend_decode(int64_t, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, at::Tensor,
                                  const model::VarlenSpec&, double) {
  TILLER_CHECK(false, "the paged decode kernel is not built (CPU build)");
  return {};
}
#endif

}  // namespace tiller::engine
