#include "engine/model_runner.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "model/host_upload.h"
#include "tiller/core/error.h"
#include "tiller/dist/communicator.h"
#include "tiller/model/sampling.h"
#include "tiller/model/transformer.h"

namespace tiller::engine {
namespace {

// The step's view of the paged cache for model::block_forward.
class PagedKv : public model::KvCache {
 public:
  PagedKv(const at::Tensor& cache, at::Tensor slots, at::Tensor gather)
      : cache_(cache), slots_(std::move(slots)), gather_(std::move(gather)) {}

  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const model::VarlenSpec& spec, double scale, model::AttentionBackend backend) override {
    at::Tensor kc = cache_[layer][0], vc = cache_[layer][1];
    kc.index_copy_(0, slots_, k);
    vc.index_copy_(0, slots_, v);
    if (!gather_.defined()) return model::varlen_attention(q, k, v, spec, scale, backend);
    return model::varlen_attention(q, kc.index_select(0, gather_), vc.index_select(0, gather_), spec, scale,
                                   backend);
  }

 private:
  at::Tensor cache_;
  at::Tensor slots_, gather_;
};

model::ModelConfig config_for_rank(const model::ModelConfig& cfg, int tp) {
  model::ModelConfig local = cfg;
  local.num_heads /= tp;
  local.num_kv_heads /= tp;
  local.intermediate_size /= tp;
  return local;
}

}  // namespace

struct ModelRunner::Impl {
  model::ModelConfig global;
  model::ModelWeights weights;
  model::Rope rope;
  dist::Communicator* tp = nullptr;
  int64_t block_size = 0;
  at::Tensor cache;

  Impl(const model::ModelConfig& cfg, model::ModelWeights w, dist::Communicator* comm, int64_t bs)
      : global(cfg), weights(std::move(w)), rope(cfg), tp(comm), block_size(bs) {}
};

ModelRunner::ModelRunner(const model::ModelConfig& cfg, model::ModelWeights weights, at::Device device,
                         int64_t block_size, dist::Communicator* tp)
    : local_(config_for_rank(cfg, tp ? tp->size() : 1)), device_(device) {
  TILLER_CHECK(block_size > 0, "block_size must be > 0");
  TILLER_CHECK(weights.embed.defined() && weights.embed.device() == device, "engine weights must be on {}",
               device.str());
  impl_ = std::make_unique<Impl>(cfg, std::move(weights), tp, block_size);
}

ModelRunner::~ModelRunner() = default;

int64_t ModelRunner::block_bytes() const {
  return 2 * local_.num_layers * impl_->block_size * local_.kv_size() *
         static_cast<int64_t>(impl_->weights.embed.element_size());
}

void ModelRunner::allocate_cache(int64_t num_blocks) {
  TILLER_CHECK(num_blocks > 0, "the KV cache needs at least one block");
  impl_->cache = at::zeros({local_.num_layers, 2, num_blocks * impl_->block_size, local_.num_kv_heads, local_.head_dim},
                           impl_->weights.embed.options());
  num_blocks_ = num_blocks;
}

ModelRunner::Sampled ModelRunner::run(const StepBatch& b, bool sample) {
  Impl& m = *impl_;
  TILLER_CHECK(m.cache.defined(), "run() before allocate_cache()");
  c10::InferenceMode guard;
  const int64_t t = b.num_tokens(), n = b.num_seqs(), bs = m.block_size;
  // Copy-on-write: a sample's first write into a block it shares.
  for (const auto& c : b.copies)
    m.cache.narrow(2, c.to * bs, c.count).copy_(m.cache.narrow(2, c.from * bs, c.count));
  // Every int64 input in one upload: tokens, positions, slots, gather, sample rows, cu_q, cu_k.
  std::vector<int64_t> words;
  words.reserve(static_cast<size_t>(4 * t + 2 * n + 2));
  words.insert(words.end(), b.tokens.begin(), b.tokens.end());
  words.insert(words.end(), b.positions.begin(), b.positions.end());
  bool cached = false;
  model::VarlenSpec spec;
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lq = b.lens_q[i], lk = b.lens_k[i];
    TILLER_CHECK(lq > 0 && lk >= lq && static_cast<int64_t>(b.tables[i].size()) * bs >= lk,
                 "step batch: sequence {} has {} new of {} tokens in {} blocks", i, lq, lk, b.tables[i].size());
    for (int64_t s = lk - lq; s < lk; ++s) words.push_back(b.tables[i][s / bs] * bs + s % bs);
    cached |= lk > lq;
    cu_q.push_back(cu_q.back() + lq);
    cu_k.push_back(cu_k.back() + lk);
    spec.max_q = std::max(spec.max_q, lq);
    spec.max_k = std::max(spec.max_k, lk);
  }
  TILLER_CHECK(cu_q.back() == t, "step batch: query lengths cover {} of {} tokens", cu_q.back(), t);
  const int64_t gather_len = cached ? cu_k.back() : 0;
  for (int64_t i = 0; i < n && cached; ++i)
    for (int64_t s = 0; s < b.lens_k[i]; ++s) words.push_back(b.tables[i][s / bs] * bs + s % bs);
  words.insert(words.end(), b.sample_rows.begin(), b.sample_rows.end());
  words.insert(words.end(), cu_q.begin(), cu_q.end());
  words.insert(words.end(), cu_k.begin(), cu_k.end());
  at::Tensor dev = model::upload(words, device_);
  int64_t at_word = 0;
  auto take = [&](int64_t len) {
    at::Tensor v = dev.narrow(0, at_word, len);
    at_word += len;
    return v;
  };
  at::Tensor tokens = take(t), positions = take(t), slots = take(t), gather = take(gather_len);
  at::Tensor rows = take(static_cast<int64_t>(b.sample_rows.size()));
  spec.cu_q = take(n + 1).to(at::kInt);
  spec.cu_k = take(n + 1).to(at::kInt);
  spec.lens_q = b.lens_q;
  spec.lens_k = b.lens_k;

  PagedKv kv(m.cache, slots, cached ? gather : at::Tensor());
  model::BlockContext ctx;
  std::tie(ctx.cos, ctx.sin) = m.rope.tables(positions, m.weights.embed.scalar_type(), b.lens_q);
  ctx.attn = spec;
  ctx.cache = &kv;
  if (m.tp && m.tp->size() > 1)
    ctx.reduce_partial_sums = [comm = m.tp](at::Tensor& x) { comm->all_reduce(x)->wait_on_stream(); };
  at::Tensor x = model::embed(m.weights.embed, tokens);
  for (int64_t l = 0; l < local_.num_layers; ++l) x = model::block_forward(local_, l, m.weights.layers[l], x, ctx);
  Sampled out;
  if (!sample || b.sample_rows.empty()) return out;
  at::Tensor h = model::final_norm(local_, m.weights.final_norm, x.index_select(0, rows));
  model::SampledTokens drawn = model::sample_tokens(model::logits(h, m.weights.lm_head), b.sampling);
  at::Tensor host = at::stack({drawn.tokens.to(at::kDouble), drawn.logprobs.to(at::kDouble)}).cpu();
  const auto* p = host.data_ptr<double>();
  const auto s = static_cast<size_t>(b.sample_rows.size());
  for (size_t i = 0; i < s; ++i) {
    out.tokens.push_back(static_cast<int64_t>(p[i]));
    out.logprobs.push_back(static_cast<float>(p[s + i]));
  }
  return out;
}

}  // namespace tiller::engine
