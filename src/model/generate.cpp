#include "tiller/model/generate.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/model/sampling.h"
#include "tiller/model/transformer.h"

namespace tiller::model {

void SamplingParams::validate() const {
  if (!greedy && !(temperature > 0)) throw ConfigError(fmt::format("temperature must be > 0, got {}", temperature));
  if (!(top_p > 0 && top_p <= 1)) throw ConfigError(fmt::format("top_p must be in (0, 1], got {}", top_p));
  if (top_k < 0) throw ConfigError(fmt::format("top_k must be >= 0, got {}", top_k));
  if (!(min_p >= 0 && min_p < 1)) throw ConfigError(fmt::format("min_p must be in [0, 1), got {}", min_p));
  if (max_new_tokens < 1 || max_new_tokens > kMaxNewTokens)
    throw ConfigError(fmt::format("max_new_tokens must be in [1, {}], got {}", kMaxNewTokens, max_new_tokens));
  if (top_k > kMaxNewTokens) throw ConfigError(fmt::format("top_k must be at most {}, got {}", kMaxNewTokens, top_k));
}

std::vector<Completion> generate(const ModelConfig& cfg, const ModelWeights& w,
                                 const std::vector<std::vector<int64_t>>& prompts, const SamplingParams& params,
                                 int64_t batch_size) {
  params.validate();
  TILLER_CHECK(batch_size > 0, "batch_size must be > 0");
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) throw ConfigError(fmt::format("prompt {} is empty", i));
    for (int64_t id : prompts[i])
      if (id < 0 || id >= cfg.vocab_size)
        throw ConfigError(fmt::format("prompt {}: token id {} is outside the vocabulary [0, {})", i, id, cfg.vocab_size));
  }
  c10::AutoGradMode no_grad(false);
  const at::Device device = w.embed.device();
  std::vector<Completion> out(prompts.size());
  for (size_t start = 0; start < prompts.size(); start += batch_size) {
    const size_t n = std::min(prompts.size() - start, static_cast<size_t>(batch_size));
    DenseKvCache cache(cfg.num_layers, static_cast<int64_t>(n));
    std::vector<std::vector<int64_t>> step(prompts.begin() + start, prompts.begin() + start + n);
    std::vector<size_t> live(n);  // batch slot -> prompt index within the batch
    for (size_t i = 0; i < n; ++i) live[i] = i;
    // The cache holds one entry per live slot; finished slots are dropped from it.
    while (!live.empty()) {
      std::vector<int64_t> starts;
      for (size_t s = 0; s < live.size(); ++s) starts.push_back(cache.lens[s]);
      PackedBatch batch = PackedBatch::pack(step, device, starts);
      at::Tensor h = forward_hidden(cfg, w, batch, &cache);
      at::Tensor last_rows = (batch.cu_seqlens.narrow(0, 1, batch.num_seqs()).to(at::kLong) - 1);
      SamplingRows rows;
      for (size_t s = 0; s < live.size(); ++s)
        rows.add(params.greedy ? 0.0f : static_cast<float>(params.temperature), static_cast<float>(params.top_p),
                 params.top_k, static_cast<float>(params.min_p),
                 sampling_uniform(params.seed + start + live[s], static_cast<int64_t>(out[start + live[s]].tokens.size())));
      SampledTokens drawn = sample_tokens(logits(h.index_select(0, last_rows), w.lm_head), rows);
      at::Tensor tokens = drawn.tokens.cpu(), logprobs = drawn.logprobs.cpu();
      std::vector<size_t> keep;
      std::vector<std::vector<int64_t>> next;
      for (size_t s = 0; s < live.size(); ++s) {
        Completion& c = out[start + live[s]];
        const int64_t tok = tokens[s].item<int64_t>();
        const float lp = logprobs[s].item<float>();
        c.tokens.push_back(tok);
        c.logprobs.push_back(lp);
        const bool stop = std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), tok) !=
                          params.stop_token_ids.end();
        if (stop) c.finish_reason = "stop";
        else if (static_cast<int64_t>(c.tokens.size()) >= params.max_new_tokens) c.finish_reason = "length";
        else {
          keep.push_back(s);
          next.push_back({tok});
        }
      }
      if (keep.size() != live.size()) {
        DenseKvCache kept(cfg.num_layers, static_cast<int64_t>(keep.size()));
        std::vector<size_t> kept_live;
        for (size_t j = 0; j < keep.size(); ++j) {
          for (int64_t l = 0; l < cfg.num_layers; ++l) {
            kept.k[l][j] = cache.k[l][keep[j]];
            kept.v[l][j] = cache.v[l][keep[j]];
          }
          kept.lens[j] = cache.lens[keep[j]];
          kept_live.push_back(live[keep[j]]);
        }
        cache = std::move(kept);
        live = std::move(kept_live);
      }
      step = std::move(next);
    }
  }
  return out;
}

}  // namespace tiller::model
