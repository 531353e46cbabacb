// The engine's view of its paged KV cache for one step (model::KvCache), and a decode step's
// inputs in one device buffer; private to src/engine (model_runner.cpp runs steps through it).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "engine/step_batch.h"
#include "tiller/core/error.h"
#include "tiller/model/attention.h"
#include "tiller/model/transformer.h"

namespace tiller::engine {

// A decode step's device inputs, int32, in one buffer laid out as
//   [tokens | positions | slots | seq_lens | offsets] (each `rows` long) then the block lists,
// so that one upload carries them. Rows past the batch are padding: token 0 at position 0, no
// slot (-1), no keys (length 0), which the kernels skip.
struct DecodeInputs {
  at::Tensor tokens, positions, slots, seq_lens, offsets, blocks;
  int64_t splits = 1;     // of the paged decode kernel
  int64_t pack_keys = 0;  // its PagedDecode::pack_keys
};

// Host words of a decode step for a buffer of `rows` rows (>= the batch).
void fill_decode_words(const StepBatch& b, int64_t rows, int64_t bs, std::vector<int32_t>& w);
// Views of DecodeInputs over a buffer of `rows` rows filled by fill_decode_words, for `batch` of them.
DecodeInputs decode_views(const at::Tensor& dev, int64_t rows, int64_t batch);

// The step's view of the paged cache for model::block_forward. Gather mode (prefill and mixed
// steps, and every step on CPU): int64 slots of the new tokens, and of each sequence's context
// when some sequence has cached tokens. Decode mode: the paged kernel over DecodeInputs.
// An FP8 cache (`scales` defined, [layers, 2, slots, kv_heads] fp32) stores each new K/V row as
// model::fp8::quantize_rows codes and scale, and attention reads every row dequantized, the step's
// own included.
class PagedKv : public model::KvCache {
 public:
  PagedKv(const at::Tensor& cache, const at::Tensor& scales, at::Tensor slots, at::Tensor gather)
      : cache_(cache), scales_(scales), slots_(std::move(slots)), gather_(std::move(gather)) {}
  PagedKv(const at::Tensor& cache, const at::Tensor& scales, const DecodeInputs* decode, int64_t block_size)
      : cache_(cache), scales_(scales), decode_(decode), block_size_(block_size) {}

  // Decode mode: the kernel rotates q and the new keys with these tables [rows, head_dim] (the
  // step's), so block_forward hands them over before RoPE.
  void rotate_with(const at::Tensor& cos, const at::Tensor& sin) {
    TILLER_CHECK(decode_ != nullptr, "PagedKv: RoPE in attention is for decode steps");
    cos_ = cos;
    sin_ = sin;
  }
  bool applies_rope() const override { return cos_.defined(); }

  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const model::VarlenSpec& spec, double scale, model::AttentionBackend backend) override {
    at::Tensor kc = cache_[layer][0], vc = cache_[layer][1];
    if (decode_) return attend_decode(layer, kc, vc, q, k, v, spec, scale);
    if (scales_.defined()) return attend_fp8(layer, kc, vc, q, k, v, spec, scale, backend);
    kc.index_copy_(0, slots_, k);
    vc.index_copy_(0, slots_, v);
    if (!gather_.defined()) return model::varlen_attention(q, k, v, spec, scale, backend);
    return model::varlen_attention(q, kc.index_select(0, gather_), vc.index_select(0, gather_), spec, scale,
                                   backend);
  }

 private:
  at::Tensor attend_decode(int64_t layer, const at::Tensor& kc, const at::Tensor& vc, at::Tensor q, at::Tensor k,
                           at::Tensor v, const model::VarlenSpec& spec, double scale);

  // Gather mode over an FP8 cache (float8_e4m3fn, indexed as bytes: ATen's CPU index ops take no
  // float8).
  at::Tensor attend_fp8(int64_t layer, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const model::VarlenSpec& spec, double scale,
                        model::AttentionBackend backend);

  at::Tensor cache_, scales_;
  at::Tensor slots_, gather_;
  at::Tensor cos_, sin_;
  const DecodeInputs* decode_ = nullptr;
  int64_t block_size_ = 0;
};

// Decode batch buckets of the captured graphs: 1, 2, 4, 8, then multiples of 8.
inline int64_t graph_bucket(int64_t n) {
  if (n <= 8) return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8;
  return (n + 7) / 8 * 8;
}

}  // namespace tiller::engine
