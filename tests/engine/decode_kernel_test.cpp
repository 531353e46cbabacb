// The decode-attention kernels on their own, against fp32 attention computed with ATen from the
// same inputs: every dtype, both kernels (tensor cores for bf16/fp16 query-head groups, CUDA
// cores otherwise), ragged shuffled block lists, block sizes that do not divide the lengths,
// windows, empty sequences, a strided query, split counts from 1 to 16, the step's own K/V rows
// stored by the call, and the tensor-core kernel's items on four warps, on one (pack_keys: all of
// them, or the short ones beside long ones); and RoPE inside the tensor-core kernel against the
// RoPE kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "model/cuda/paged_attention.h"
#include "tiller/model/fp8.h"
#include "tiller/model/transformer.h"
#endif

namespace tiller::engine {
#ifdef TILLER_HAVE_CUDA_KERNELS
namespace cuda = model::cuda;
#endif
namespace {

#ifdef TILLER_HAVE_CUDA_KERNELS
struct DecodeCase {
  at::ScalarType dtype;
  int64_t head_dim, heads, kv_heads, block_size, window;
};

cuda::DType kernel_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? cuda::DType::kBFloat16 : t == at::kHalf ? cuda::DType::kHalf : cuda::DType::kFloat;
}

// Max and mean absolute difference of the kernel's output from the fp32 reference, for one case
// at one split count (0: the engine's choice for the batch). With `step_rows`, each sequence's
// last K/V row is passed as this step's (k_new/v_new) while its cache row holds garbage: the
// call must store the row into the cache and attend to the new values. With `fp8`, the cache is
// FP8 (PagedDecode::cache_fp8): every row quantized by write_kv_fp8, whose codes and scales must
// equal the CPU's model::fp8::quantize_rows bit for bit, and the reference attends over the rows
// dequantized to the dtype. `pack_keys`: PagedDecode::pack_keys.
std::pair<double, double> decode_error(const DecodeCase& c, int64_t splits_wanted, uint64_t seed, bool step_rows,
                                       bool fp8 = false, int64_t pack_keys = 0) {
  const at::Device dev("cuda:0");
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  std::mt19937_64 rng(seed);
  const std::vector<int32_t> lens = {1, 0, 16, 17, 255, 300, 64, 5, 129, 1000};
  const auto batch = static_cast<int64_t>(lens.size());
  std::vector<int32_t> offsets, blocks;
  int64_t total_blocks = 0;
  for (int32_t len : lens) total_blocks += (len + c.block_size - 1) / c.block_size + 1;
  std::vector<int32_t> ids(static_cast<size_t>(total_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  for (int32_t len : lens) {
    offsets.push_back(static_cast<int32_t>(blocks.size()));
    for (int64_t i = 0; i < (len + c.block_size - 1) / c.block_size; ++i) blocks.push_back(ids[next++]);
  }
  const int64_t slots = total_blocks * c.block_size, dim = c.head_dim;
  at::manual_seed(seed);
  const at::Tensor k_cache = at::randn({slots, c.kv_heads, dim}, fp32).to(c.dtype);
  const at::Tensor v_cache = at::randn({slots, c.kv_heads, dim}, fp32).to(c.dtype);
  at::Tensor kf = k_cache.to(at::kFloat), vf = v_cache.to(at::kFloat);  // the reference's
  at::Tensor k8, v8, k_scale, v_scale;
  if (fp8) {
    k8 = at::empty({slots, c.kv_heads, dim}, fp32.dtype(at::kFloat8_e4m3fn));
    v8 = at::empty_like(k8);
    k_scale = at::empty({slots, c.kv_heads}, fp32);
    v_scale = at::empty_like(k_scale);
    const at::Tensor every = at::arange(slots, fp32.dtype(at::kInt));
    cuda::write_kv_fp8(kernel_dtype(c.dtype), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                       v_cache.stride(0), k8.data_ptr(), v8.data_ptr(), k_scale.data_ptr<float>(),
                       v_scale.data_ptr<float>(), every.data_ptr<int32_t>(), slots, c.kv_heads, dim,
                       c10::cuda::getCurrentCUDAStream(0).stream());
    const model::fp8::GroupQuantized kq = model::fp8::quantize_rows(k_cache.cpu());
    const model::fp8::GroupQuantized vq = model::fp8::quantize_rows(v_cache.cpu());
    EXPECT_TRUE(at::equal(k8.cpu().view(at::kByte), kq.q.view(at::kByte)));
    EXPECT_TRUE(at::equal(v8.cpu().view(at::kByte), vq.q.view(at::kByte)));
    EXPECT_TRUE(at::equal(k_scale.cpu(), kq.scale));
    EXPECT_TRUE(at::equal(v_scale.cpu(), vq.scale));
    kf = model::fp8::dequantize_rows(kq, c.dtype).to(dev, at::kFloat);
    vf = model::fp8::dequantize_rows(vq, c.dtype).to(dev, at::kFloat);
  }
  // This step's rows, as views of wider rows; their cache rows overwritten with garbage.
  std::vector<int32_t> last_slot;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int32_t t = lens[b] - 1;
    last_slot.push_back(t < 0 ? -1 : blocks[static_cast<size_t>(offsets[b] + t / c.block_size)] * c.block_size +
                                         t % c.block_size);
  }
  const at::Tensor step_kv = at::zeros({batch, 3 * c.kv_heads * dim}, fp32.dtype(c.dtype));
  const at::Tensor k_new = step_kv.narrow(1, 0, c.kv_heads * dim).view({batch, c.kv_heads, dim});
  const at::Tensor v_new = step_kv.narrow(1, 2 * c.kv_heads * dim, c.kv_heads * dim).view({batch, c.kv_heads, dim});
  if (step_rows)
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t slot = last_slot[static_cast<size_t>(b)];
      if (slot < 0) continue;
      k_new[b].copy_(k_cache[slot]);
      v_new[b].copy_(v_cache[slot]);
      k_cache[slot].fill_(100.0);
      v_cache[slot].fill_(-100.0);
    }
  // The query as a view of a wider row (like the fused QKV projection's output).
  const at::Tensor qkv = at::randn({batch, (c.heads + 2 * c.kv_heads) * dim}, fp32).to(c.dtype);
  const at::Tensor q = qkv.narrow(1, 0, c.heads * dim).view({batch, c.heads, dim});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));

  auto i32 = [&](const std::vector<int32_t>& v) {
    return at::tensor(v, at::TensorOptions().dtype(at::kInt)).to(dev);
  };
  const at::Tensor d_lens = i32(lens), d_offsets = i32(offsets), d_blocks = i32(blocks), d_slots = i32(last_slot);
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  cuda::PagedDecode a;
  a.dtype = kernel_dtype(c.dtype);
  a.q = q.data_ptr();
  a.q_token_stride = qkv.stride(0);
  a.k_cache = fp8 ? k8.data_ptr() : k_cache.data_ptr();
  a.v_cache = fp8 ? v8.data_ptr() : v_cache.data_ptr();
  if (fp8) {
    a.cache_fp8 = true;
    a.k_scale = k_scale.data_ptr<float>();
    a.v_scale = v_scale.data_ptr<float>();
  }
  const at::Tensor out = at::full({batch, c.heads, dim}, 7.0, fp32.dtype(c.dtype));
  a.out = out.data_ptr();
  a.seq_lens = d_lens.data_ptr<int32_t>();
  a.offsets = d_offsets.data_ptr<int32_t>();
  a.blocks = d_blocks.data_ptr<int32_t>();
  a.batch = batch;
  a.heads = c.heads;
  a.kv_heads = c.kv_heads;
  a.head_dim = dim;
  a.block_size = c.block_size;
  a.window = c.window;
  a.scale = static_cast<float>(scale);
  a.pack_keys = pack_keys;
  a.splits = splits_wanted > 0 ? splits_wanted
                               : cuda::paged_decode_splits(a.dtype, dim, batch, c.heads, c.kv_heads, max_len, 0);
  at::Tensor ws;
  if (a.splits > 1) {
    ws = at::empty({cuda::paged_decode_workspace_floats(batch, c.heads, dim, a.splits)}, fp32);
    a.workspace = ws.data_ptr<float>();
  }
  if (step_rows) {
    a.k_new = k_new.data_ptr();
    a.v_new = v_new.data_ptr();
    a.k_new_stride = k_new.stride(0);
    a.v_new_stride = v_new.stride(0);
    a.slots = d_slots.data_ptr<int32_t>();
  }
  cuda::paged_decode_attention(a, c10::cuda::getCurrentCUDAStream(0).stream());
  if (fp8) {
    // The same call over a cache in the dtype that holds the dequantized rows (exact: they are
    // dtype values) must give the FP8 call's output bit for bit: each kernel turns the codes into
    // exactly those values and then does the same arithmetic.
    const at::Tensor kd = kf.to(c.dtype).contiguous(), vd = vf.to(c.dtype).contiguous();
    const at::Tensor plain = at::full({batch, c.heads, dim}, 7.0, fp32.dtype(c.dtype));
    cuda::PagedDecode p = a;
    p.cache_fp8 = false;
    p.k_scale = p.v_scale = nullptr;
    p.k_cache = kd.data_ptr();
    p.v_cache = vd.data_ptr();
    p.out = plain.data_ptr();
    cuda::paged_decode_attention(p, c10::cuda::getCurrentCUDAStream(0).stream());
    EXPECT_TRUE(at::equal(out, plain)) << "the FP8 cache's output differs from the same kernel's over its dequantized "
                                          "rows by up to "
                                       << (out.to(at::kFloat) - plain.to(at::kFloat)).abs().max().item<double>();
  }
  if (step_rows) {  // the step's rows are in the cache now
    const at::Tensor idx = at::tensor(last_slot, at::kLong).clamp_min(0).to(dev);
    const at::Tensor had = d_lens.gt(0);
    EXPECT_TRUE(at::equal(k_cache.index_select(0, idx).index({had}), k_new.index({had})));
    EXPECT_TRUE(at::equal(v_cache.index_select(0, idx).index({had}), v_new.index({had})));
  }

  // Reference: gather each sequence's keys, attention in fp32.
  const at::Tensor qf = q.to(at::kFloat);
  const at::Tensor got = out.to(at::kFloat);
  double max_err = 0, sum_err = 0;
  const int64_t group = c.heads / c.kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[static_cast<size_t>(b)];
    const int64_t start = c.window > 0 ? std::max<int64_t>(0, len - c.window) : 0;
    at::Tensor want = at::zeros({c.heads, dim}, fp32);
    if (len > 0) {
      std::vector<int64_t> rows;
      for (int64_t t = start; t < len; ++t)
        rows.push_back(blocks[static_cast<size_t>(offsets[static_cast<size_t>(b)] + t / c.block_size)] * c.block_size +
                       t % c.block_size);
      const at::Tensor idx = at::tensor(rows, at::kLong).to(dev);
      const at::Tensor kb = kf.index_select(0, idx).repeat_interleave(group, 1);  // [n, heads, dim]
      const at::Tensor vb = vf.index_select(0, idx).repeat_interleave(group, 1);
      const at::Tensor scores = at::einsum("hd,nhd->hn", {qf[b], kb}) * scale;
      want = at::einsum("hn,nhd->hd", {scores.softmax(1), vb});
    }
    const at::Tensor err = (got[b] - want).abs();
    max_err = std::max(max_err, err.max().item<double>());
    sum_err += err.sum().item<double>();
  }
  return {max_err, sum_err / static_cast<double>(batch * c.heads * dim)};
}
#endif

TEST(EngineGpu, PagedDecodeKernelsEqualFp32Attention) {
#ifndef TILLER_HAVE_CUDA_KERNELS
  GTEST_SKIP() << "not the CUDA build";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<DecodeCase> cases = {
      // Tensor cores: Qwen2-7B's group of 7 at 128, Qwen2-0.5B's 7 at 64, groups of 2 and 16.
      {at::kBFloat16, 128, 28, 4, 16, 0},  {at::kBFloat16, 64, 14, 2, 16, 0}, {at::kHalf, 128, 8, 4, 5, 0},
      {at::kBFloat16, 64, 16, 1, 7, 100},  {at::kHalf, 64, 14, 2, 16, 37},
      // CUDA cores: fp32, no GQA, head sizes the tensor-core kernel does not take.
      {at::kFloat, 128, 28, 4, 16, 0},     {at::kBFloat16, 128, 4, 4, 16, 0}, {at::kBFloat16, 256, 8, 2, 16, 0},
      {at::kFloat, 64, 14, 2, 5, 37},      {at::kHalf, 32, 6, 2, 3, 0},
  };
  // pack_keys 300: the lengths up to 300 (and shorter splits) on one warp, 1000 on four.
  for (const DecodeCase& c : cases)
    for (int64_t splits : {0, 1, 3, 16})
      for (int64_t pack : {int64_t{0}, int64_t{300}, int64_t{1} << 20}) {
        const bool step_rows = splits != 1;
        SCOPED_TRACE(::testing::Message() << c10::toString(c.dtype) << " head_dim " << c.head_dim << " heads "
                                          << c.heads << "/" << c.kv_heads << " block " << c.block_size << " window "
                                          << c.window << " splits " << splits << (step_rows ? " step rows" : "")
                                          << " pack_keys " << pack);
        const auto [max_err, mean_err] =
            decode_error(c, splits, 11 + static_cast<uint64_t>(splits), step_rows, false, pack);
        // fp32: summation order only. bf16/fp16: the inputs are exact in both paths, so what
        // remains is P rounded to the input type and the rounded output (~2^-8 relative in bf16).
        const bool fp32 = c.dtype == at::kFloat;
        EXPECT_LT(max_err, fp32 ? 2e-5 : c.dtype == at::kHalf ? 4e-3 : 2e-2);
        EXPECT_LT(mean_err, fp32 ? 2e-6 : c.dtype == at::kHalf ? 5e-4 : 3e-3);
      }
#endif
}

// Where the engine asks for one-warp items: only for the tensor-core kernel's shapes, and only
// where its four-warp grid would take more than two waves of the GPU.
TEST(EngineGpu, PagedDecodePacksOnlyGridsPastTwoWaves) {
#ifndef TILLER_HAVE_CUDA_KERNELS
  GTEST_SKIP() << "not the CUDA build";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const auto bf16 = cuda::DType::kBFloat16;
  // Head size 128: 3 four-warp blocks an SM; 64: 4.
  EXPECT_EQ(cuda::paged_decode_pack_keys(bf16, 128, 3 * sms / 2, 28, 4, 1, 512, 0), 0);
  EXPECT_EQ(cuda::paged_decode_pack_keys(bf16, 128, 3 * sms / 2 + 1, 28, 4, 1, 512, 0), 512);
  EXPECT_EQ(cuda::paged_decode_pack_keys(bf16, 64, 2 * sms, 14, 2, 2, 512, 0), 0);
  EXPECT_EQ(cuda::paged_decode_pack_keys(bf16, 64, 2 * sms, 14, 2, 3, 512, 0), 512);
  EXPECT_EQ(cuda::paged_decode_pack_keys(bf16, 128, 4096, 28, 4, 1, 0, 0), 0);                  // not wanted
  EXPECT_EQ(cuda::paged_decode_pack_keys(cuda::DType::kFloat, 128, 4096, 28, 4, 1, 512, 0), 0);  // CUDA cores
  EXPECT_EQ(cuda::paged_decode_pack_keys(bf16, 256, 4096, 8, 2, 1, 512, 0), 0);
#endif
}

// An FP8 KV cache (engines.kv_cache_dtype: fp8): write_kv_fp8 quantizes as the CPU does, bit for
// bit; both kernels reading the codes and scales give bit for bit what they give over a bf16/fp16
// cache of the dequantized rows, and equal fp32 attention over those rows within the bounds of
// the bf16/fp16 cases above. Qwen2-7B's and -0.5B's groups, fp16 and a window (the tensor-core
// kernel); head sizes 16 and 256 (the CUDA-core kernel).
TEST(EngineGpu, Fp8KvCacheDecodeEqualsAttentionOverItsDequantizedRows) {
#ifndef TILLER_HAVE_CUDA_KERNELS
  GTEST_SKIP() << "not the CUDA build";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<DecodeCase> cases = {
      {at::kBFloat16, 128, 28, 4, 16, 0}, {at::kBFloat16, 64, 14, 2, 16, 0}, {at::kHalf, 128, 8, 4, 5, 0},
      {at::kBFloat16, 256, 8, 2, 16, 0},  {at::kBFloat16, 16, 4, 4, 3, 0},   {at::kHalf, 64, 14, 2, 16, 37},
  };
  for (const DecodeCase& c : cases)
    for (int64_t splits : {0, 1, 3, 16})
      for (int64_t pack : {int64_t{0}, int64_t{300}}) {
        SCOPED_TRACE(::testing::Message() << c10::toString(c.dtype) << " head_dim " << c.head_dim << " heads "
                                          << c.heads << "/" << c.kv_heads << " block " << c.block_size << " window "
                                          << c.window << " splits " << splits << " pack_keys " << pack);
        const auto [max_err, mean_err] =
            decode_error(c, splits, 23 + static_cast<uint64_t>(splits), false, true, pack);
        EXPECT_LT(max_err, c.dtype == at::kHalf ? 4e-3 : 2e-2);
        EXPECT_LT(mean_err, c.dtype == at::kHalf ? 5e-4 : 3e-3);
      }
#endif
}

// RoPE in the tensor-core kernel (PagedDecode::rope_cos): q and this step's key given before
// RoPE must give bit for bit the output and cache rows of the same call on inputs that the RoPE
// kernel (model::apply_rope, what the engine ran before) rotated first. Ragged lengths, empty
// sequences, a window, several split counts, a strided query.
TEST(EngineGpu, PagedDecodeRotatesLikeTheRopeKernel) {
#ifndef TILLER_HAVE_CUDA_KERNELS
  GTEST_SKIP() << "not the CUDA build";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  c10::InferenceMode no_grad;
  const at::Device dev("cuda:0");
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  const std::vector<DecodeCase> cases = {{at::kBFloat16, 128, 28, 4, 16, 0}, {at::kBFloat16, 64, 14, 2, 16, 0},
                                         {at::kHalf, 128, 8, 4, 5, 0},       {at::kBFloat16, 64, 16, 1, 7, 100}};
  EXPECT_FALSE(cuda::paged_decode_rotates(cuda::DType::kFloat, 128, 28, 4));   // the CUDA-core kernel's shapes
  EXPECT_FALSE(cuda::paged_decode_rotates(cuda::DType::kBFloat16, 256, 8, 2));
  const std::vector<int32_t> lens = {1, 0, 16, 17, 255, 300, 64, 5, 129, 1000};
  const auto batch = static_cast<int64_t>(lens.size());
  for (const DecodeCase& c : cases) {
    ASSERT_TRUE(cuda::paged_decode_rotates(kernel_dtype(c.dtype), c.head_dim, c.heads, c.kv_heads));
    for (int64_t splits : {1, 3, 16})
      for (int64_t pack : {int64_t{0}, int64_t{300}}) {
        SCOPED_TRACE(::testing::Message() << c10::toString(c.dtype) << " head_dim " << c.head_dim << " heads "
                                          << c.heads << "/" << c.kv_heads << " splits " << splits << " pack_keys " << pack);
        const int64_t dim = c.head_dim;
        std::vector<int32_t> offsets, blocks, slots;
        for (int32_t len : lens) {
          offsets.push_back(static_cast<int32_t>(blocks.size()));
          const auto first = static_cast<int32_t>(blocks.size());
          for (int64_t i = 0; i < (len + c.block_size - 1) / c.block_size; ++i) blocks.push_back(static_cast<int32_t>(blocks.size()));
          slots.push_back(len == 0 ? -1 : static_cast<int32_t>((first + (len - 1) / c.block_size) * c.block_size + (len - 1) % c.block_size));
        }
        const int64_t cache_rows = (static_cast<int64_t>(blocks.size()) + 1) * c.block_size;
        at::manual_seed(7 + static_cast<uint64_t>(splits));
        const at::Tensor k_cache0 = at::randn({cache_rows, c.kv_heads, dim}, fp32).to(c.dtype);
        const at::Tensor v_cache0 = at::randn({cache_rows, c.kv_heads, dim}, fp32).to(c.dtype);
        const at::Tensor qkv = at::randn({batch, (c.heads + 2 * c.kv_heads) * dim}, fp32).to(c.dtype);
        const at::Tensor q = qkv.narrow(1, 0, c.heads * dim).view({batch, c.heads, dim});
        const at::Tensor k_new = qkv.narrow(1, c.heads * dim, c.kv_heads * dim).view({batch, c.kv_heads, dim});
        const at::Tensor v_new = qkv.narrow(1, (c.heads + c.kv_heads) * dim, c.kv_heads * dim).view({batch, c.kv_heads, dim});
        // HF tables at each sequence's last position.
        const at::Tensor pos = (at::tensor(lens, at::kFloat).to(dev) - 1).clamp_min(0);
        const at::Tensor inv = at::pow(10000.0, -at::arange(0, dim, 2, fp32) / static_cast<double>(dim));
        const at::Tensor ang = at::cat({pos.unsqueeze(1) * inv, pos.unsqueeze(1) * inv}, 1);
        const at::Tensor cos = ang.cos().to(c.dtype), sin = ang.sin().to(c.dtype);
        auto i32 = [&](const std::vector<int32_t>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kInt)).to(dev); };
        const at::Tensor d_lens = i32(lens), d_offsets = i32(offsets), d_blocks = i32(blocks), d_slots = i32(slots);
        at::Tensor ws = at::empty({std::max<int64_t>(1, cuda::paged_decode_workspace_floats(batch, c.heads, dim, splits))}, fp32);
        // One call: (query, step K, their token strides, tables or none) -> (output, K cache, V cache).
        auto call = [&](const at::Tensor& qq, const at::Tensor& kk, bool tables, int64_t pack_keys) {
          at::Tensor kc = k_cache0.clone(), vc = v_cache0.clone();
          at::Tensor out = at::full({batch, c.heads, dim}, 7.0, fp32.dtype(c.dtype));
          cuda::PagedDecode a;
          a.dtype = kernel_dtype(c.dtype);
          a.q = qq.data_ptr();
          a.q_token_stride = qq.stride(0);
          a.k_cache = kc.data_ptr();
          a.v_cache = vc.data_ptr();
          a.out = out.data_ptr();
          a.seq_lens = d_lens.data_ptr<int32_t>();
          a.offsets = d_offsets.data_ptr<int32_t>();
          a.blocks = d_blocks.data_ptr<int32_t>();
          a.batch = batch;
          a.heads = c.heads;
          a.kv_heads = c.kv_heads;
          a.head_dim = dim;
          a.block_size = c.block_size;
          a.window = c.window;
          a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
          a.splits = splits;
          a.pack_keys = pack_keys;
          a.workspace = splits > 1 ? ws.data_ptr<float>() : nullptr;
          a.k_new = kk.data_ptr();
          a.v_new = v_new.data_ptr();
          a.k_new_stride = kk.stride(0);
          a.v_new_stride = v_new.stride(0);
          a.slots = d_slots.data_ptr<int32_t>();
          if (tables) {
            a.rope_cos = cos.data_ptr();
            a.rope_sin = sin.data_ptr();
          }
          cuda::paged_decode_attention(a, c10::cuda::getCurrentCUDAStream(0).stream());
          return std::make_tuple(out, kc, vc);
        };
        const auto [out_fused, kc_fused, vc_fused] = call(q, k_new, true, pack);
        const auto [out_ref, kc_ref, vc_ref] =
            call(model::apply_rope(q, cos, sin), model::apply_rope(k_new, cos, sin), false, pack);
        EXPECT_TRUE(at::equal(out_fused, out_ref)) << "max difference "
                                                   << (out_fused.to(at::kFloat) - out_ref.to(at::kFloat)).abs().max().item<double>();
        EXPECT_TRUE(at::equal(kc_fused, kc_ref));
        EXPECT_TRUE(at::equal(vc_fused, vc_ref));
        EXPECT_FALSE(at::equal(kc_fused, k_cache0));  // the step's keys went in
        // One warp's online softmax over a sequence's tiles is not four warps' merged (with one split,
      // where sequences of 17 to 300 keys have several tiles), so the short items ran on one warp.
      if (pack > 0 && splits == 1) {
          const auto [out_wide, kc_wide, vc_wide] = call(q, k_new, true, 0);
          EXPECT_FALSE(at::equal(out_fused, out_wide)) << "pack_keys " << pack << " put no item on one warp";
          EXPECT_TRUE(at::equal(kc_fused, kc_wide));
          EXPECT_TRUE(at::equal(vc_fused, vc_wide));
        }
      }
  }
#endif
}

}  // namespace
}  // namespace tiller::engine
