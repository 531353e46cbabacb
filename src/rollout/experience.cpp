#include "tiller/rollout/experience.h"

#include <algorithm>
#include <limits>

#include "tiller/core/error.h"

namespace tiller::rollout {
namespace {

void append_ids(std::vector<int32_t>& out, const std::vector<int64_t>& ids) {
  for (int64_t id : ids) {
    TILLER_CHECK(id >= 0 && id <= std::numeric_limits<int32_t>::max(), "token id {} is not a vocabulary index", id);
    out.push_back(static_cast<int32_t>(id));
  }
}

}  // namespace

int64_t Rollout::add(int64_t prompt_index, int64_t sample_index, const std::vector<int64_t>& prompt_tokens,
                     const std::vector<int64_t>& response, const std::vector<float>& engine_logprobs, bool hit_length,
                     const std::vector<int64_t>& version_starts, const std::vector<uint64_t>& versions,
                     uint64_t version) {
  TILLER_CHECK(engine_logprobs.size() == response.size(), "{} log-probs for {} response tokens",
               engine_logprobs.size(), response.size());
  TILLER_CHECK(version_starts.size() == versions.size(), "{} version runs with {} versions", version_starts.size(),
               versions.size());
  for (size_t i = 0; i < version_starts.size(); ++i)
    TILLER_CHECK(version_starts[i] >= 0 && static_cast<size_t>(version_starts[i]) < std::max<size_t>(response.size(), 1) &&
                     (i == 0 ? version_starts[i] == 0 : version_starts[i] > version_starts[i - 1]),
                 "version run {} starts at token {} of a response of {}", i, version_starts[i], response.size());
  const int64_t s = size();
  if (run_offset.empty()) run_offset.push_back(0);
  prompt.push_back(prompt_index);
  sample.push_back(sample_index);
  seq_offset.push_back(static_cast<int64_t>(tokens.size()));
  prompt_len.push_back(static_cast<int64_t>(prompt_tokens.size()));
  response_len.push_back(static_cast<int64_t>(response.size()));
  resp_offset.push_back(response_tokens());
  truncated.push_back(hit_length ? 1 : 0);
  score.push_back(0.f);
  if (versions.empty()) {
    run_start.push_back(0);
    run_version.push_back(version);
  } else {
    run_start.insert(run_start.end(), version_starts.begin(), version_starts.end());
    run_version.insert(run_version.end(), versions.begin(), versions.end());
  }
  run_offset.push_back(static_cast<int64_t>(run_start.size()));
  append_ids(tokens, prompt_tokens);
  append_ids(tokens, response);
  engine_logp.insert(engine_logp.end(), engine_logprobs.begin(), engine_logprobs.end());
  const size_t n = engine_logp.size();
  logp.resize(n, 0.f);
  advantages.resize(n, 0.f);
  if (layout.ref) ref_logp.resize(n, 0.f);
  if (layout.critic) {
    values.resize(n, 0.f);
    returns.resize(n, 0.f);
  }
  return s;
}

int64_t Rollout::add_from(const Rollout& o, int64_t s, int64_t prompt_index) {
  TILLER_CHECK(o.layout.ref == layout.ref && o.layout.critic == layout.critic, "rollouts of different layouts");
  const int64_t d = size();
  if (run_offset.empty()) run_offset.push_back(0);
  prompt.push_back(prompt_index);
  sample.push_back(o.sample[s]);
  seq_offset.push_back(static_cast<int64_t>(tokens.size()));
  prompt_len.push_back(o.prompt_len[s]);
  response_len.push_back(o.response_len[s]);
  resp_offset.push_back(response_tokens());
  truncated.push_back(o.truncated[s]);
  score.push_back(o.score[s]);
  run_start.insert(run_start.end(), o.run_start.begin() + o.run_offset[s], o.run_start.begin() + o.run_offset[s + 1]);
  run_version.insert(run_version.end(), o.run_version.begin() + o.run_offset[s],
                     o.run_version.begin() + o.run_offset[s + 1]);
  run_offset.push_back(static_cast<int64_t>(run_start.size()));
  tokens.insert(tokens.end(), o.tokens.begin() + o.seq_offset[s], o.tokens.begin() + o.seq_offset[s] + o.seq_len(s));
  const auto copy = [&](std::vector<float>& dst, const std::vector<float>& src) {
    dst.insert(dst.end(), src.begin() + o.resp_offset[s], src.begin() + o.resp_offset[s] + o.response_len[s]);
  };
  copy(engine_logp, o.engine_logp);
  copy(logp, o.logp);
  copy(advantages, o.advantages);
  if (layout.ref) copy(ref_logp, o.ref_logp);
  if (layout.critic) {
    copy(values, o.values);
    copy(returns, o.returns);
  }
  return d;
}

uint64_t Rollout::oldest_version(int64_t s) const {
  return *std::min_element(run_version.begin() + run_offset[s], run_version.begin() + run_offset[s + 1]);
}

uint64_t Rollout::newest_version(int64_t s) const {
  return *std::max_element(run_version.begin() + run_offset[s], run_version.begin() + run_offset[s + 1]);
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
  for (auto* v : {&prompt, &sample, &seq_offset, &prompt_len, &response_len, &resp_offset, &run_offset, &run_start})
    v->clear();
  truncated.clear();
  run_version.clear();
  tokens.clear();
  for (auto* v : {&score, &engine_logp, &logp, &advantages, &ref_logp, &values, &returns}) v->clear();
}

size_t Rollout::bytes() const {
  size_t b = 0;
  for (auto* v : {&prompt, &sample, &seq_offset, &prompt_len, &response_len, &resp_offset, &run_offset, &run_start})
    b += v->capacity() * sizeof(int64_t);
  b += truncated.capacity() + run_version.capacity() * sizeof(uint64_t) + tokens.capacity() * sizeof(int32_t);
  for (auto* v : {&score, &engine_logp, &logp, &advantages, &ref_logp, &values, &returns})
    b += v->capacity() * sizeof(float);
  return b;
}

}  // namespace tiller::rollout
