// The paged-attention CUDA kernels (the engine's decode steps over the paged KV cache, and the
// bitwise mode's prefill, model/batch_invariant.cpp), with a plain C++ interface
// (raw pointers, the stream as void*) so that no CUDA header reaches the C++ side. Built only in
// the GPU build (TILLER_HAVE_CUDA_KERNELS); elsewhere the model runner gathers the context and
// calls varlen attention instead.
//
// Cache of one layer: K and V each [slots, kv_heads, head_dim], contiguous, slot s of a sequence
// at row blocks[offsets[b] + s / block_size] * block_size + s % block_size. The block lists of
// the batch are ragged (one flat int32 array with per-sequence offsets), so a step uploads only
// the blocks its sequences use.
//
// Everything here is capturable in a CUDA graph: lengths and block lists are read on the device,
// and the grid depends only on the batch size and the split count.
#pragma once

#include <cstdint>

#include "model/cuda/kernels.h"

namespace tiller::model::cuda {

// Head sizes the decode kernel has instances for (16, 32, 64, 128, 256).
bool paged_decode_supports(int64_t head_dim);

// Stores this step's K and V rows [tokens, kv_heads, head_dim] (head stride head_dim, element
// stride 1, token strides given, in elements) into their cache slots; slot < 0 skips the token
// (padding rows of a captured batch).
void write_kv(DType dtype, const void* k, const void* v, int64_t k_token_stride, int64_t v_token_stride,
              void* k_cache, void* v_cache, const int32_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim,
              void* stream);

// An FP8 KV cache's store of this step's rows (PagedDecode::cache_fp8): K and V [tokens, kv_heads,
// head_dim] of `dtype` (head stride head_dim, element stride 1, token strides given, in elements)
// quantized per (token, KV head) row exactly as model::fp8::quantize_rows does (s = amax / 448, 1
// for zeros; code = e4m3(x / s), nearest even, saturating), the codes into k_cache / v_cache
// [slots, kv_heads, head_dim] bytes and s into k_scale / v_scale [slots, kv_heads]; slot < 0 skips
// the token.
void write_kv_fp8(DType dtype, const void* k, const void* v, int64_t k_token_stride, int64_t v_token_stride,
                  void* k_cache, void* v_cache, float* k_scale, float* v_scale, const int32_t* slots, int64_t tokens,
                  int64_t kv_heads, int64_t head_dim, void* stream);

struct PagedDecode {
  DType dtype = DType::kBFloat16;
  const void* q = nullptr;       // [batch, heads, head_dim]; head stride head_dim
  int64_t q_token_stride = 0;    // elements
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  void* out = nullptr;           // [batch, heads, head_dim], contiguous
  const int32_t* seq_lens = nullptr;  // [batch] keys per sequence (cached + this step's); 0: output zeros
  const int32_t* offsets = nullptr;   // [batch] into blocks
  const int32_t* blocks = nullptr;
  int64_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0, block_size = 0;
  int64_t window = 0;            // > 0: the query sees only the last `window` keys
  float scale = 1.0f;
  int64_t splits = 1;            // KV ranges per (sequence, head group), combined at the end
  float* workspace = nullptr;    // paged_decode_workspace_floats(...) floats when splits > 1
  // Optional: this step's K and V rows [batch, kv_heads, head_dim] (head stride head_dim, token
  // strides given, 16-byte aligned rows) and their cache slots (< 0: padding, skipped). The call
  // then also stores them into the cache — the tensor-core kernel does it in the same launch and
  // takes each sequence's last key from these rows — so no write_kv is needed.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t k_new_stride = 0, v_new_stride = 0;
  const int32_t* slots = nullptr;
  // Optional, with k_new/v_new and only where paged_decode_rotates says so: RoPE tables [batch,
  // head_dim] (HF layout: cos and sin of each row's position, q's dtype, contiguous, 16-byte
  // aligned). q and k_new then come before RoPE; the kernel rotates q and this step's key (and
  // stores the rotated key), so no RoPE kernel runs before it.
  const void* rope_cos = nullptr;
  const void* rope_sin = nullptr;
  // Optional: contiguous keys instead of block lists (algo.logprob_match = bitwise runs the
  // trainer's and the engine's prefill attention through these kernels, so that a query sums its
  // keys in the decode step's order): key t of row b at slot key_base[b] + t; offsets and blocks
  // are then unused. Each row is one query (a token) with its own seq_lens[b] keys.
  const int32_t* key_base = nullptr;
  // Optional: an FP8 KV cache (engines.kv_cache_dtype fp8). k_cache and v_cache then hold e4m3
  // codes, and k_scale / v_scale [slots, kv_heads] fp32 one scale per cached row; a key's value is
  // code * scale rounded to `dtype`, as model::fp8::dequantize_rows gives it. bf16/fp16 queries,
  // either kernel (the tensor-core kernel's shapes go to it: it turns each tile into T in shared
  // memory before its MMAs); k_new, rope_cos and key_base stay unset (write_kv_fp8 has stored the
  // step's rows first).
  bool cache_fp8 = false;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  // The tensor-core kernel: > 0, an item (sequence, KV head, split) of at most this many keys in
  // its split runs on one warp instead of four (a short context's tiles are too few to pay for
  // four warps' fixed costs: their loads, RoPE and merge); items of more keys, and every item at
  // 0, on four warps. The two differ in their last bits (one online softmax over the tiles against
  // four merged), so algo.logprob_match = bitwise, whose prefill form sums keys as the four warps
  // do, leaves it 0.
  int64_t pack_keys = 0;
};

// algo.logprob_match = bitwise: causal attention of packed query tokens over contiguous keys
// (the trainer's varlen forward, the engine's prefill) where every query sums its keys exactly as
// the tensor-core decode kernel does for a decode step of that token with one split (the same
// 16-key tiles dealt to the same 4 partial states, merged in the same order), so the two agree
// bit for bit; but 16 query tokens of one head share each K/V tile instead of one token's group.
// For the shapes paged_decode_prefill_serves names (else each query runs as a decode step,
// PagedDecode::key_base). K and V [keys, kv_heads, head_dim] contiguous; q [tokens, heads,
// head_dim] (head stride head_dim, token stride given); out [tokens, heads, head_dim] contiguous.
struct PrefillRows {
  DType dtype = DType::kBFloat16;
  const void* q = nullptr;
  int64_t q_token_stride = 0;  // elements
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  // [count][4] int32: the block's first query row, its rows (1 to 16, consecutive tokens of one
  // sequence), the sequence's first key row, and the key position of the first query row (its
  // keys are 0 ..= position).
  const int32_t* blocks = nullptr;
  int64_t count = 0, heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 1.0f;
};
bool paged_decode_prefill_serves(DType dtype, int64_t head_dim, int64_t heads, int64_t kv_heads);
void paged_decode_prefill(const PrefillRows& a, void* stream);

// Whether paged_decode_attention takes RoPE tables for this shape (the tensor-core kernel's:
// bf16/fp16, head size 64 or 128, 2 to 16 query heads per KV head).
bool paged_decode_rotates(DType dtype, int64_t head_dim, int64_t heads, int64_t kv_heads);

// Split count for a batch: enough (sequence, head group, split) work items to fill the GPU, at
// most 16, and (when known, > 0) no split shorter than 64 keys of `max_len` (an FP8 cache's the
// same: its shapes go to the same kernel).
int64_t paged_decode_splits(DType dtype, int64_t head_dim, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t max_len, int device);
int64_t paged_decode_workspace_floats(int64_t batch, int64_t heads, int64_t head_dim, int64_t splits);
// PagedDecode::pack_keys for a batch: `wanted` where the tensor-core kernel serves the shape and
// its grid of four-warp blocks (batch x KV heads x splits) would take more than two waves of the
// GPU, else 0. One warp per short item then fits the batch in one wave (7B at batch 256: 1,024
// blocks for 396 places, its attention 51 -> 40 us a layer on H200, decode +1.5% bf16, +3.7%
// FP8); with fewer blocks, four warps an item are faster (measured on H200 with one wave as the
// limit: 1.5B at batch 256, 512 blocks, one warp an item cost 8% of its decode rate; 0.5B, 512
// blocks for 528 places, 16%).
int64_t paged_decode_pack_keys(DType dtype, int64_t head_dim, int64_t batch, int64_t heads, int64_t kv_heads,
                               int64_t splits, int64_t wanted, int device);

// Causal attention of each sequence's one query (at position seq_len - 1) over its cached keys:
// split-KV flash decoding; a second kernel combines the splits by their log-sum-exp. Two kernels:
// - bf16/fp16 with head size 64 or 128 and 2 to 16 query heads per KV head (GQA): tensor cores.
//   One thread block per (sequence, KV head, split); its query heads are the rows of one MMA
//   tile, so each K/V row is read once for all of them; QK^T and PV run as m16n8k16 MMAs with
//   fp32 accumulation (P rounded to the input type, as flash attention does).
// - otherwise (fp32, other head sizes, no GQA): CUDA cores, one thread block per (sequence, KV
//   head, chunk of <= 4 query heads, split), each K/V row read once per chunk.
// Both keep the online softmax in fp32.
void paged_decode_attention(const PagedDecode& args, void* stream);

}  // namespace tiller::model::cuda
