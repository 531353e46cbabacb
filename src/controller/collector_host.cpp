// The collector as its sample loop's host (collector.h, tiller/controller/sample_loop.h): requests
// sent to a group's engine and tracked until their last sample is back, finished samples checked
// and handed on to arrive().
#include <cmath>

#include <fmt/format.h>

#include "controller/collector.h"
#include "tiller/core/error.h"

namespace tiller::controller {

RolloutCollector::Group& RolloutCollector::live_group(int64_t ordinal, const char* call) {
  auto it = outstanding_.find(ordinal);
  if (it == outstanding_.end())
    throw Error(fmt::format("sample loop '{}' called {} for prompt group {}, which is not outstanding (dropped, or "
                            "never dispatched)",
                            cfg_.loop, call, ordinal));
  return it->second;
}

const data::Prompt& RolloutCollector::prompt(int64_t group) const {
  auto it = outstanding_.find(group);
  TILLER_CHECK(it != outstanding_.end(), "sample loop '{}': prompt group {} is not outstanding", cfg_.loop, group);
  return prompts_.at(it->second.dataset_index);
}

uint64_t RolloutCollector::generate(int64_t group, engine::Request r, bool whole_group) {
  Group& g = live_group(group, "generate");
  if (whole_group) {
    r.id = static_cast<uint64_t>(group);
    if (g.whole_sent || r.n != cfg_.n)
      throw Error(fmt::format("sample loop '{}': the whole-group request of prompt group {} is sent once, with n = {} "
                              "samples (it had n = {}{})",
                              cfg_.loop, group, cfg_.n, r.n, g.whole_sent ? ", and was sent already" : ""));
    g.whole_sent = true;
  } else {
    r.id = next_request_++;
  }
  if (r.n < 1 || r.n > cfg_.n)
    throw Error(fmt::format("sample loop '{}': a request of {} samples for prompt group {} (1 .. {})", cfg_.loop, r.n,
                            group, cfg_.n));
  const auto e = static_cast<size_t>(g.engine);
  if (in_flight_[e] == 0) last_progress_[e] = cfg_.clock->now();
  in_flight_[e] += r.n;
  live_[r.id] = {group, g.engine, r.n, r.keep_session, false, r, std::vector<uint8_t>(static_cast<size_t>(r.n), 0)};
  try {
    engines_.submit(e, r, version_);
  } catch (const CommError& err) {  // its stream broke: a standalone engine leaves, the request moves
    engine_failed(e, fmt::format("{}: {}", engines_.name(e), err.what()));
  }
  return r.id;
}

void RolloutCollector::abort(int64_t group, uint64_t request) {
  auto it = live_.find(request);
  if (it == live_.end() || it->second.aborted || it->second.remaining <= 0) return;  // every sample is back already
  TILLER_CHECK(it->second.group == group, "sample loop '{}': request {} is not prompt group {}'s", cfg_.loop, request,
               group);
  it->second.aborted = true;
  engines_.abort(static_cast<size_t>(it->second.engine), request);
}

void RolloutCollector::release_session(int64_t group, engine::SessionKey key) {
  engines_.release_session(static_cast<size_t>(live_group(group, "release_session").engine), key);
}

void RolloutCollector::count_session_prefix(int64_t tokens) { batch_->session_prefix_tokens += tokens; }

void RolloutCollector::finish(int64_t group, FinishedSample f) {
  Group& g = live_group(group, "finish");
  const std::string who = fmt::format("sample loop '{}', {}", cfg_.loop, sample_where(group, f.sample));
  if (f.sample < 0 || f.sample >= cfg_.n || g.finished[static_cast<size_t>(f.sample)])
    throw Error(fmt::format("{}: finished {} (each of samples 0 .. {} once)", who,
                            f.sample < 0 || f.sample >= cfg_.n ? "out of range" : "twice", cfg_.n - 1));
  const size_t len = f.out.tokens.size();
  if (f.out.logprobs.size() != len)
    throw Error(fmt::format("{}: {} response tokens and {} log-probs (one each)", who, len, f.out.logprobs.size()));
  if (loop_turns_ && (f.turns.loss_mask.size() != len || f.turns.ends.empty() ||
                      f.turns.rewards.size() != f.turns.ends.size()))
    throw Error(fmt::format("{}: a loss mask of {} for {} tokens, {} turn ends and {} turn rewards (one mask value a "
                            "token, at least one turn, one reward a turn)",
                            who, f.turns.loss_mask.size(), len, f.turns.ends.size(), f.turns.rewards.size()));
  if (!loop_turns_ && (!f.turns.loss_mask.empty() || !f.turns.ends.empty()))
    throw Error(fmt::format("{}: turn information from a loop registered without turns", who));
  for (size_t t = 0; t < f.turns.ends.size(); ++t) {
    const int64_t end = f.turns.ends[t];
    if (end < 0 || end >= static_cast<int64_t>(len) || (t > 0 && end <= f.turns.ends[t - 1]))
      throw Error(fmt::format("{}: turn {} ends at token {} (turn ends rise, within the {} response tokens)", who, t + 1,
                              end, len));
    if (!std::isfinite(f.turns.rewards[t]))
      throw Error(fmt::format("{}: turn {}'s reward is {}, not a finite number", who, t + 1, f.turns.rewards[t]));
  }
  if (f.out.version_starts.size() != f.out.versions.size())
    throw Error(fmt::format("{}: {} weight-version runs with {} starts (the engine's runs, continued over the loop's "
                            "requests)",
                            who, f.out.versions.size(), f.out.version_starts.size()));
  g.finished[static_cast<size_t>(f.sample)] = 1;
  Staged st;
  st.out = std::move(f.out);
  st.out.request_id = static_cast<uint64_t>(group);
  st.out.sample = f.sample;
  st.turns = std::move(f.turns);
  for (float r : st.turns.rewards) st.turn_rewards += r;
  st.prompt = std::move(f.prompt);
  batch_->env_seconds += f.env_seconds;
  batch_->env_calls += f.env_calls;
  batch_->drifts += f.drifts;
  arrive(g, std::move(st));
}

}  // namespace tiller::controller
