// The packed batch, the dense KV cache of model::generate and the block context over them
// (model/transformer.h).
#include <algorithm>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "tiller/core/error.h"
#include "tiller/model/transformer.h"

namespace tiller::model {

PackedBatch PackedBatch::pack(const std::vector<std::vector<int64_t>>& seqs, at::Device device,
                              const std::vector<int64_t>& start_positions) {
  TILLER_CHECK(start_positions.empty() || start_positions.size() == seqs.size(),
               "{} start positions for {} sequences", start_positions.size(), seqs.size());
  PackedBatch b;
  std::vector<int64_t> tokens, positions;
  std::vector<int32_t> cu{0};
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t start = start_positions.empty() ? 0 : start_positions[i];
    for (size_t j = 0; j < seqs[i].size(); ++j) {
      tokens.push_back(seqs[i][j]);
      positions.push_back(start + static_cast<int64_t>(j));
    }
    b.seq_lens.push_back(static_cast<int64_t>(seqs[i].size()));
    TILLER_CHECK(tokens.size() < (1u << 31), "a packed batch holds at most 2^31 tokens");
    cu.push_back(static_cast<int32_t>(tokens.size()));
  }
  const auto n = static_cast<int64_t>(tokens.size());
  b.tokens = at::from_blob(tokens.data(), {n}, at::kLong).to(device);
  b.positions = at::from_blob(positions.data(), {n}, at::kLong).to(device);
  b.cu_seqlens = at::from_blob(cu.data(), {static_cast<int64_t>(cu.size())}, at::kInt).to(device);
  if (device.is_cpu()) {  // from_blob does not copy for CPU -> CPU
    b.tokens = b.tokens.clone();
    b.positions = b.positions.clone();
    b.cu_seqlens = b.cu_seqlens.clone();
  }
  return b;
}

DenseKvCache::DenseKvCache(int64_t layers, int64_t seqs)
    : k(layers, std::vector<at::Tensor>(seqs)), v(layers, std::vector<at::Tensor>(seqs)), lens(seqs, 0) {}

// Appends this layer's new K/V per sequence; attention reads the packed cache + new, sequence by
// sequence. The lengths advance after the last layer.
at::Tensor DenseKvCache::attend(int64_t layer, const at::Tensor& q, const at::Tensor& nk_all, const at::Tensor& nv_all,
                                const VarlenSpec& spec, double scale, AttentionBackend backend) {
  std::vector<at::Tensor> ks, vs;
  int64_t offset = 0;
  for (size_t i = 0; i < spec.lens_q.size(); ++i) {
    at::Tensor nk = nk_all.narrow(0, offset, spec.lens_q[i]), nv = nv_all.narrow(0, offset, spec.lens_q[i]);
    offset += spec.lens_q[i];
    at::Tensor& ck = k[layer][i];
    at::Tensor& cv = v[layer][i];
    ck = ck.defined() ? at::cat({ck, nk}, 0) : nk.clone();
    cv = cv.defined() ? at::cat({cv, nv}, 0) : nv.clone();
    ks.push_back(ck);
    vs.push_back(cv);
  }
  if (layer == static_cast<int64_t>(k.size()) - 1)
    for (size_t i = 0; i < spec.lens_q.size(); ++i) lens[i] += spec.lens_q[i];
  return varlen_attention(q, at::cat(ks, 0), at::cat(vs, 0), spec, scale, backend);
}

BlockContext make_block_context(const ModelConfig& cfg, const Rope& rope, const PackedBatch& batch,
                                at::ScalarType dtype, DenseKvCache* cache, AttentionBackend backend) {
  BlockContext ctx;
  std::tie(ctx.cos, ctx.sin) = rope.tables(batch.positions, dtype, batch.seq_lens);
  ctx.backend = backend;
  ctx.cache = cache;
  ctx.replay_routes = batch.routes;
  if (!cache) {
    ctx.attn = VarlenSpec::self(batch.cu_seqlens, batch.seq_lens);
    return ctx;
  }
  TILLER_CHECK(static_cast<int64_t>(cache->lens.size()) == batch.num_seqs(), "cache has {} sequences, batch {}",
               cache->lens.size(), batch.num_seqs());
  VarlenSpec& s = ctx.attn;
  s.cu_q = batch.cu_seqlens;
  s.lens_q = batch.seq_lens;
  std::vector<int32_t> cu_k{0};
  for (size_t i = 0; i < batch.seq_lens.size(); ++i) {
    const int64_t lk = cache->lens[i] + batch.seq_lens[i];
    s.lens_k.push_back(lk);
    s.max_q = std::max(s.max_q, batch.seq_lens[i]);
    s.max_k = std::max(s.max_k, lk);
    cu_k.push_back(cu_k.back() + static_cast<int32_t>(lk));
  }
  s.cu_k = at::from_blob(cu_k.data(), {static_cast<int64_t>(cu_k.size())}, at::kInt).clone().to(batch.tokens.device());
  return ctx;
}

}  // namespace tiller::model
