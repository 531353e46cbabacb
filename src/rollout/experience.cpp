#include "tiller/rollout/experience.h"

#include "tiller/core/error.h"

namespace tiller::rollout {

int64_t Rollout::add(int64_t prompt_index, int64_t sample_index, const std::vector<int64_t>& prompt_tokens,
                     const std::vector<int64_t>& response, const std::vector<float>& engine_logprobs,
                     bool hit_length) {
  TILLER_CHECK(engine_logprobs.size() == response.size(), "{} log-probs for {} response tokens",
               engine_logprobs.size(), response.size());
  const int64_t s = size();
  prompt.push_back(prompt_index);
  sample.push_back(sample_index);
  seq_offset.push_back(static_cast<int64_t>(tokens.size()));
  prompt_len.push_back(static_cast<int64_t>(prompt_tokens.size()));
  response_len.push_back(static_cast<int64_t>(response.size()));
  resp_offset.push_back(response_tokens());
  truncated.push_back(hit_length ? 1 : 0);
  score.push_back(0.f);
  tokens.insert(tokens.end(), prompt_tokens.begin(), prompt_tokens.end());
  tokens.insert(tokens.end(), response.begin(), response.end());
  engine_logp.insert(engine_logp.end(), engine_logprobs.begin(), engine_logprobs.end());
  const size_t n = engine_logp.size();
  for (auto* v : {&logp, &ref_logp, &values, &advantages, &returns}) v->resize(n, 0.f);
  return s;
}

std::vector<int64_t> Rollout::seq_lens() const {
  std::vector<int64_t> out(prompt.size());
  for (size_t s = 0; s < out.size(); ++s) out[s] = prompt_len[s] + response_len[s];
  return out;
}

std::vector<int64_t> Rollout::response_ids(int64_t s) const {
  const auto b = tokens.begin() + seq_offset[s] + prompt_len[s];
  return {b, b + response_len[s]};
}

void Rollout::clear() {
  for (auto* v : {&prompt, &sample, &seq_offset, &prompt_len, &response_len, &resp_offset, &tokens}) v->clear();
  truncated.clear();
  for (auto* v : {&score, &engine_logp, &logp, &ref_logp, &values, &advantages, &returns}) v->clear();
}

size_t Rollout::bytes() const {
  size_t b = 0;
  for (auto* v : {&prompt, &sample, &seq_offset, &prompt_len, &response_len, &resp_offset, &tokens})
    b += v->capacity() * sizeof(int64_t);
  b += truncated.capacity();
  for (auto* v : {&score, &engine_logp, &logp, &ref_logp, &values, &advantages, &returns})
    b += v->capacity() * sizeof(float);
  return b;
}

}  // namespace tiller::rollout
