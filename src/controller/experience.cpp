#include "tiller/controller/experience.h"

#include <algorithm>
#include <limits>

#include "tiller/core/error.h"

namespace tiller::controller {
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
                     uint64_t version, const TurnInfo* turn_info) {
  TILLER_CHECK(engine_logprobs.size() == response.size(), "{} log-probs for {} response tokens",
               engine_logprobs.size(), response.size());
  TILLER_CHECK(version_starts.size() == versions.size(), "{} version runs with {} versions", version_starts.size(),
               versions.size());
  for (size_t i = 0; i < version_starts.size(); ++i)
    TILLER_CHECK(version_starts[i] >= 0 && static_cast<size_t>(version_starts[i]) < std::max<size_t>(response.size(), 1) &&
                     (i == 0 ? version_starts[i] == 0 : version_starts[i] > version_starts[i - 1]),
                 "version run {} starts at token {} of a response of {}", i, version_starts[i], response.size());
  TILLER_CHECK(layout.turns || turn_info == nullptr, "turn information for a rollout without layout.turns");
  if (turn_info) {
    TILLER_CHECK(turn_info->loss_mask.size() == response.size(), "a loss mask of {} for {} response tokens",
                 turn_info->loss_mask.size(), response.size());
    TILLER_CHECK(turn_info->ends.size() == turn_info->rewards.size(), "{} turn ends with {} rewards",
                 turn_info->ends.size(), turn_info->rewards.size());
    // A sample a loop discarded (every mask 0: nothing of it is trained) keeps its turns' places.
    const bool discarded = std::none_of(turn_info->loss_mask.begin(), turn_info->loss_mask.end(),
                                        [](uint8_t m) { return m != 0; });
    for (size_t i = 0; i < turn_info->ends.size(); ++i) {
      const int64_t e = turn_info->ends[i];
      TILLER_CHECK(e >= 0 && static_cast<size_t>(e) < response.size() &&
                       (discarded || turn_info->loss_mask[static_cast<size_t>(e)]) && (i == 0 || e > turn_info->ends[i - 1]),
                   "turn {} ends at token {} of a response of {}, not after the turn before on a model token", i, e,
                   response.size());
    }
  }
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
  if (route_offset.empty()) route_offset.push_back(0);
  route_offset.push_back(static_cast<int64_t>(routes.size()));
  append_ids(tokens, prompt_tokens);
  append_ids(tokens, response);
  engine_logp.insert(engine_logp.end(), engine_logprobs.begin(), engine_logprobs.end());
  const size_t n = engine_logp.size();
  if (layout.turns) {
    if (turn_offset.empty()) turn_offset.push_back(0);
    if (turn_info) {
      loss_mask.insert(loss_mask.end(), turn_info->loss_mask.begin(), turn_info->loss_mask.end());
      turn_end.insert(turn_end.end(), turn_info->ends.begin(), turn_info->ends.end());
      turn_reward.insert(turn_reward.end(), turn_info->rewards.begin(), turn_info->rewards.end());
    } else {
      loss_mask.resize(n, 1);
    }
    turn_offset.push_back(static_cast<int64_t>(turn_end.size()));
  }
  logp.resize(n, 0.f);
  advantages.resize(n, 0.f);
  if (layout.ref) ref_logp.resize(n, 0.f);
  if (layout.critic) {
    values.resize(n, 0.f);
    returns.resize(n, 0.f);
  }
  return s;
}

void Rollout::set_routes(const std::vector<int16_t>& rows, int64_t width) {
  TILLER_CHECK(size() > 0 && route_offset.back() == static_cast<int64_t>(routes.size()) &&
                   route_offset[static_cast<size_t>(size()) - 1] == route_offset.back(),
               "set_routes: the last sample has routes already");
  TILLER_CHECK(width > 0 && rows.size() % static_cast<size_t>(width) == 0, "{} routes do not make rows of {}",
               rows.size(), width);
  TILLER_CHECK(route_width == 0 || route_width == width, "routes of width {} in a rollout of width {}", width,
               route_width);
  const int64_t s = size() - 1, n = static_cast<int64_t>(rows.size()) / width;
  TILLER_CHECK(n <= seq_len(s), "routes for {} tokens of a sample of {}", n, seq_len(s));
  route_width = width;
  routes.insert(routes.end(), rows.begin(), rows.end());
  routes.resize(routes.size() + static_cast<size_t>((seq_len(s) - n) * width), -1);
  route_offset.back() = static_cast<int64_t>(routes.size());
}

int64_t Rollout::add_from(const Rollout& o, int64_t s, int64_t prompt_index) {
  TILLER_CHECK(o.layout.ref == layout.ref && o.layout.critic == layout.critic && o.layout.turns == layout.turns,
               "rollouts of different layouts");
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
  if (route_offset.empty()) route_offset.push_back(0);
  if (o.has_routes(s)) {
    TILLER_CHECK(route_width == 0 || route_width == o.route_width, "routes of width {} in a rollout of width {}",
                 o.route_width, route_width);
    route_width = o.route_width;
    routes.insert(routes.end(), o.routes.begin() + o.route_offset[s], o.routes.begin() + o.route_offset[s + 1]);
  }
  route_offset.push_back(static_cast<int64_t>(routes.size()));
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
  if (layout.turns) {
    loss_mask.insert(loss_mask.end(), o.loss_mask.begin() + o.resp_offset[s],
                     o.loss_mask.begin() + o.resp_offset[s] + o.response_len[s]);
    if (turn_offset.empty()) turn_offset.push_back(0);
    turn_end.insert(turn_end.end(), o.turn_end.begin() + o.turn_offset[s], o.turn_end.begin() + o.turn_offset[s + 1]);
    turn_reward.insert(turn_reward.end(), o.turn_reward.begin() + o.turn_offset[s],
                       o.turn_reward.begin() + o.turn_offset[s + 1]);
    turn_offset.push_back(static_cast<int64_t>(turn_end.size()));
  }
  return d;
}

namespace {

// `v` as segments [off[s], off[s + 1]) taken in `order`; `off` becomes their new offsets.
template <typename T>
void permute_segments(std::vector<T>& v, std::vector<int64_t>& off, const std::vector<int64_t>& order) {
  std::vector<T> out;
  out.reserve(v.size());
  std::vector<int64_t> new_off{0};
  new_off.reserve(off.size());
  for (int64_t s : order) {
    out.insert(out.end(), v.begin() + off[static_cast<size_t>(s)], v.begin() + off[static_cast<size_t>(s) + 1]);
    new_off.push_back(static_cast<int64_t>(out.size()));
  }
  v = std::move(out);
  off = std::move(new_off);
}

template <typename T>
void permute(std::vector<T>& v, const std::vector<int64_t>& order) {
  std::vector<T> out;
  out.reserve(order.size());
  for (int64_t s : order) out.push_back(v[static_cast<size_t>(s)]);
  v = std::move(out);
}

}  // namespace

bool Rollout::canonicalize() {
  const int64_t b = size();
  std::vector<int64_t> order(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s) order[static_cast<size_t>(s)] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return std::make_pair(prompt[x], sample[x]) < std::make_pair(prompt[y], sample[y]);
  });
  if (std::is_sorted(order.begin(), order.end())) return false;
  // The per-token arrays, each a sample's response_len values at resp_offset.
  const std::vector<int64_t> resp_before = resp_offset;
  for (std::vector<float>* v : {&engine_logp, &logp, &advantages, &ref_logp, &values, &returns}) {
    if (v->empty()) continue;
    std::vector<int64_t> off(resp_before);
    off.push_back(response_tokens());
    permute_segments(*v, off, order);
  }
  if (!loss_mask.empty()) {
    std::vector<int64_t> off(resp_before);
    off.push_back(static_cast<int64_t>(loss_mask.size()));
    permute_segments(loss_mask, off, order);
  }
  {
    std::vector<int64_t> off(seq_offset);
    off.push_back(static_cast<int64_t>(tokens.size()));
    permute_segments(tokens, off, order);
    off.pop_back();
    seq_offset = std::move(off);
  }
  std::vector<int64_t> run_off = run_offset;
  permute_segments(run_start, run_off, order);
  permute_segments(run_version, run_offset, order);
  permute_segments(routes, route_offset, order);
  if (layout.turns) {
    std::vector<int64_t> turn_off = turn_offset;
    permute_segments(turn_end, turn_off, order);
    permute_segments(turn_reward, turn_offset, order);
  }
  for (std::vector<int64_t>* v : {&prompt, &sample, &prompt_len, &response_len}) permute(*v, order);
  permute(truncated, order);
  permute(score, order);
  resp_offset.assign(static_cast<size_t>(b), 0);
  for (int64_t s = 1; s < b; ++s) resp_offset[static_cast<size_t>(s)] = resp_offset[static_cast<size_t>(s) - 1] + response_len[s - 1];
  return true;
}

int64_t Rollout::model_tokens(int64_t s) const {
  if (!layout.turns) return response_len[s];
  int64_t n = 0;
  for (int64_t t = resp_offset[s]; t < resp_offset[s] + response_len[s]; ++t) n += loss_mask[static_cast<size_t>(t)];
  return n;
}

double Rollout::total_reward(int64_t s) const {
  double r = score[s];
  if (layout.turns)
    for (int64_t i = turn_offset[s]; i < turn_offset[s + 1]; ++i) r += turn_reward[static_cast<size_t>(i)];
  return r;
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
  for (auto* v : {&prompt, &sample, &seq_offset, &prompt_len, &response_len, &resp_offset, &run_offset, &run_start,
                  &route_offset})
    v->clear();
  routes.clear();
  route_width = 0;
  truncated.clear();
  run_version.clear();
  tokens.clear();
  loss_mask.clear();
  turn_offset.clear();
  turn_end.clear();
  turn_reward.clear();
  for (auto* v : {&score, &engine_logp, &logp, &advantages, &ref_logp, &values, &returns}) v->clear();
}

size_t Rollout::bytes() const {
  size_t b = 0;
  for (auto* v : {&prompt, &sample, &seq_offset, &prompt_len, &response_len, &resp_offset, &run_offset, &run_start,
                  &route_offset})
    b += v->capacity() * sizeof(int64_t);
  b += routes.capacity() * sizeof(int16_t);
  b += truncated.capacity() + run_version.capacity() * sizeof(uint64_t) + tokens.capacity() * sizeof(int32_t);
  b += loss_mask.capacity() + (turn_offset.capacity() + turn_end.capacity()) * sizeof(int64_t) +
       turn_reward.capacity() * sizeof(float);
  for (auto* v : {&score, &engine_logp, &logp, &advantages, &ref_logp, &values, &returns})
    b += v->capacity() * sizeof(float);
  return b;
}

}  // namespace tiller::controller
