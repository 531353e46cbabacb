// The multi_turn sample loop (tiller/controller/sample_loop.h): each sample is an episode with the
// job's environment. Start gives its observation after the prompt; then per turn the engine
// generates, the environment answers (Step) and the observation's tokens are appended; the next
// turn resumes the engine's parked session of the sample (its KV cache), so only the observation
// is prefilled. A group's first turn is one request of n samples when the n Start observations are
// equal (the prompt is prefilled once); later turns are a request per sample, on the engine of its
// first. The episode ends when the environment says done, at rollout.max_turns, or when
// rollout.max_response_tokens leaves no room; then its session is closed and the engine's cache
// released. The sample's response is every token after the prompt, with a loss mask (observation
// tokens: 0) and the environment's reward per turn.
#include "controller/sample_loops.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include <fmt/format.h>

#include "controller/env_runner.h"
#include "tiller/core/error.h"
#include "tiller/env/environment.h"

namespace tiller::controller {
namespace {

class MultiTurnLoop final : public SampleLoop {
 public:
  explicit MultiTurnLoop(const SampleLoopContext& c)
      : host_(*c.host), ctx_(c), env_(c.environment, c.env_threads, c.env_timeout_s) {
    TILLER_CHECK(c.observation_tokens && c.decode, "the multi_turn loop needs observation_tokens and decode");
    TILLER_CHECK(c.n < 2048 && c.max_turns >= 1 && c.max_response_tokens >= 1, "multi_turn loop: bad sizes");
  }

  void start(int64_t group) override {
    const data::Prompt& p = host_.prompt(group);
    for (int64_t j = 0; j < ctx_.n; ++j) {
      Episode ep;
      ep.group = group;
      ep.sample = j;
      ep.session = fmt::format("{}-{}-{}", ctx_.session_prefix, group, j);
      env::EpisodeStart es;
      es.session_id = ep.session;
      es.prompt = p.text;
      es.label = p.label;
      es.data_source = p.data_source;
      es.extra_info = p.extra_info;
      es.prompt_index = static_cast<uint64_t>(p.line);
      es.sample_index = static_cast<uint32_t>(j);
      es.step = static_cast<uint64_t>(host_.step());
      const uint64_t key = episode_key(group, j);
      episodes_[key] = std::move(ep);
      env_.start(key, std::move(es));
    }
  }

  void generated(int64_t group, uint64_t request, engine::SampleOutput out) override {
    uint64_t key = episode_key(group, out.sample);
    if (auto t = turn_requests_.find(request); t != turn_requests_.end()) {
      key = t->second;
      turn_requests_.erase(t);
    }
    take_turn(episodes_.at(key), std::move(out));
  }

  bool poll() override {
    std::vector<EnvRunner::Result> results = env_.poll();
    for (EnvRunner::Result& r : results) take_env_result(r);
    return !results.empty();
  }

  void drop(int64_t group) override {
    starts_.erase(group);
    bool group_request_aborted = false;
    for (int64_t j = 0; j < ctx_.n; ++j) {
      auto it = episodes_.find(episode_key(group, j));
      if (it == episodes_.end()) continue;  // finished (or never started)
      Episode& ep = it->second;
      if (ep.live) {
        const bool group_request = ep.live_request == static_cast<uint64_t>(group);
        if (!group_request || !group_request_aborted) host_.abort(group, ep.live_request);
        group_request_aborted = group_request_aborted || group_request;
        if (!group_request) turn_requests_.erase(ep.live_request);
      }
      env_.close(ep.session);
      if (ep.has_parked) host_.release_session(group, ep.parked);
      episodes_.erase(it);
    }
  }

  int64_t waiting() const override {
    int64_t n = 0;
    for (const auto& [key, ep] : episodes_) n += ep.live ? 0 : 1;
    return n;
  }

 private:
  // A sample's episode, from its Start to its last Step.
  struct Episode {
    int64_t group = 0;
    int64_t sample = 0;
    std::string session;                // the environment's session id
    int turns = 0;                      // model turns done
    std::vector<int64_t> history;       // prompt + everything after it: the next turn's prompt
    int64_t prompt_len = 0;
    engine::SampleOutput out;           // every token after the prompt (observations' log-probs 0)
    TurnInfo info;
    engine::SessionKey parked{};        // the engine session that holds its cache
    bool has_parked = false;
    bool live = false;                  // a turn is on the engine, as request live_request
    uint64_t live_request = 0;
    env::Observation first;             // Start's observation, until the group's first request
    double env_seconds = 0;
    int64_t env_calls = 0;
  };

  static uint64_t episode_key(int64_t group, int64_t sample) {
    return (static_cast<uint64_t>(group) << 11) | static_cast<uint64_t>(sample);
  }

  void take_env_result(EnvRunner::Result& r) {
    auto it = episodes_.find(r.key);
    if (it == episodes_.end()) return;  // its group was dropped
    Episode& ep = it->second;
    const auto step_where = [&] { return fmt::format("{}, step {}", host_.where(ep.group, ep.sample), host_.step()); };
    if (!r.error.empty())  // a Start's message names the prompt line and sample already
      throw Error(r.start ? fmt::format("{} (step {})", r.error, host_.step()) : fmt::format("{} ({})", r.error, step_where()));
    ep.env_seconds += r.seconds;
    ++ep.env_calls;
    if (r.start) {
      ep.first = std::move(r.observation);
      if (++starts_[ep.group] == ctx_.n) {
        starts_.erase(ep.group);
        first_turns(ep.group);
      }
      return;
    }
    if (!std::isfinite(r.reward))
      throw Error(fmt::format("{} answered turn {} of session {} with the reward {}, which is not finite ({})",
                              env_.environment().name(), ep.turns, ep.session, r.reward, step_where()));
    ep.info.rewards.push_back(static_cast<float>(r.reward));
    if (r.done || ep.turns >= ctx_.max_turns) {
      end_episode(ep, r.done);
      return;
    }
    next_turn(ep, r.observation);
  }

  void first_turns(int64_t group) {
    // Every sample's prompt: the dataset's, then Start's observation as it is (token ids, or its
    // text tokenized without a template).
    const data::Prompt& p = host_.prompt(group);
    std::vector<Episode*> eps;
    for (int64_t j = 0; j < ctx_.n; ++j) {
      Episode& ep = episodes_.at(episode_key(group, j));
      ep.history = p.tokens;
      const std::vector<int64_t> obs = ep.first.tokens.empty() && !ep.first.text.empty()
                                           ? ctx_.observation_tokens(ep.first.text, false, /*raw=*/true)
                                           : ep.first.tokens;
      ep.history.insert(ep.history.end(), obs.begin(), obs.end());
      ep.prompt_len = static_cast<int64_t>(ep.history.size());
      ep.first = {};
      eps.push_back(&ep);
    }
    for (Episode* ep : eps)
      if (ep->prompt_len > ctx_.max_prompt_tokens)
        throw Error(fmt::format("{}: the prompt and the environment's first observation are {} tokens, over "
                                "rollout.max_prompt_tokens = {} (raise it, or shorten the observation)",
                                host_.where(group, ep->sample), ep->prompt_len, ctx_.max_prompt_tokens));
    const bool same =
        std::all_of(eps.begin(), eps.end(), [&](const Episode* ep) { return ep->history == eps[0]->history; });
    const int64_t room = std::min(ctx_.sampling.max_new_tokens, ctx_.max_response_tokens);
    const uint64_t seed = host_.seed(group);
    if (same) {  // one request of n samples: the prompt is prefilled once
      const uint64_t id = submit_turn(*eps[0], eps[0]->history, ctx_.n, seed, room, false, /*whole_group=*/true);
      for (Episode* ep : eps) {
        ep->live = true;
        ep->live_request = id;
      }
      return;
    }
    for (Episode* ep : eps) {
      const uint64_t id = submit_turn(*ep, ep->history, 1, seed + static_cast<uint64_t>(ep->sample), room, false, false);
      turn_requests_[id] = episode_key(ep->group, ep->sample);
      ep->live = true;
      ep->live_request = id;
    }
  }

  uint64_t submit_turn(const Episode& ep, std::vector<int64_t> prompt, int64_t n, uint64_t seed, int64_t max_new_tokens,
                       bool resume, bool whole_group) {
    engine::Request r;
    r.prompt = std::move(prompt);
    r.n = n;
    r.params = ctx_.sampling;
    r.params.seed = seed;
    r.params.max_new_tokens = max_new_tokens;
    r.keep_session = true;
    r.resume = resume;
    r.session = ep.parked;
    return host_.generate(ep.group, std::move(r), whole_group);
  }

  void take_turn(Episode& ep, engine::SampleOutput s) {
    TILLER_CHECK(!s.tokens.empty(), "{}: the engine returned a turn without tokens", host_.where(ep.group, ep.sample));
    ep.live = false;
    ++ep.turns;
    engine::SampleOutput& o = ep.out;
    // Routing replay: a turn's prompt is the whole history, so its routes cover every token so far.
    TILLER_CHECK(s.route_width == 0 || s.prompt_tokens == static_cast<int64_t>(ep.history.size()),
                 "{}: a turn's routes start from a prompt of {} tokens, the history has {}", host_.where(ep.group, ep.sample),
                 s.prompt_tokens, ep.history.size());
    append_turn(o, s);
    ep.info.loss_mask.insert(ep.info.loss_mask.end(), s.tokens.size(), 1);
    ep.info.ends.push_back(static_cast<int64_t>(o.tokens.size()) - 1);
    ep.history.insert(ep.history.end(), s.tokens.begin(), s.tokens.end());
    ep.parked = {s.request_id, s.sample};
    ep.has_parked = true;
    env::Action a;
    a.turn = ep.turns;
    a.text = ctx_.decode(s.tokens);
    a.tokens = std::move(s.tokens);
    a.finish_reason = s.finish_reason;
    env_.step(episode_key(ep.group, ep.sample), ep.session, std::move(a));
  }

  void next_turn(Episode& ep, const env::Observation& obs) {
    const bool closed = ep.out.finish_reason == "stop";
    const std::vector<int64_t> tokens = !obs.tokens.empty() ? obs.tokens
                                        : obs.text.empty()  ? std::vector<int64_t>{}
                                                            : ctx_.observation_tokens(obs.text, closed, false);
    const auto used = static_cast<int64_t>(ep.out.tokens.size());
    const int64_t room = ctx_.max_response_tokens - used - static_cast<int64_t>(tokens.size());
    if (room < 1) {  // no room for another turn: the episode ends without the observation
      end_episode(ep, false);
      return;
    }
    // The engine's session holds the conversation but its last sampled token.
    host_.count_session_prefix(static_cast<int64_t>(ep.history.size()) - 1);
    ep.history.insert(ep.history.end(), tokens.begin(), tokens.end());
    ep.out.tokens.insert(ep.out.tokens.end(), tokens.begin(), tokens.end());
    ep.out.logprobs.insert(ep.out.logprobs.end(), tokens.size(), 0.f);
    ep.info.loss_mask.insert(ep.info.loss_mask.end(), tokens.size(), 0);
    // Each turn draws with its own seed (the engine numbers draws from 0 in every request).
    const uint64_t seed = host_.seed(ep.group) + static_cast<uint64_t>(ep.sample) +
                          static_cast<uint64_t>(ep.turns) * 0x9E3779B97F4A7C15ull;
    const uint64_t id = submit_turn(ep, ep.history, 1, seed, std::min(ctx_.sampling.max_new_tokens, room),
                                    ep.has_parked, false);
    turn_requests_[id] = episode_key(ep.group, ep.sample);
    ep.live = true;
    ep.live_request = id;
    ep.has_parked = false;  // the resume takes the session over
  }

  void end_episode(Episode& ep, bool env_done) {
    const uint64_t key = episode_key(ep.group, ep.sample);
    env_.close(ep.session);
    if (ep.has_parked) host_.release_session(ep.group, ep.parked);
    FinishedSample f;
    f.sample = ep.sample;
    f.out = std::move(ep.out);
    f.out.sample = ep.sample;
    f.out.prompt_tokens = ep.prompt_len;
    // Truncated unless the environment ended it: the turn or token limit cut the episode short.
    f.out.finish_reason = env_done ? "stop" : "length";
    f.turns = std::move(ep.info);
    f.prompt.assign(ep.history.begin(), ep.history.begin() + ep.prompt_len);
    f.env_seconds = ep.env_seconds;
    f.env_calls = ep.env_calls + 1;  // with the Close
    const int64_t group = ep.group;
    episodes_.erase(key);
    host_.finish(group, std::move(f));
  }

  LoopHost& host_;
  SampleLoopContext ctx_;
  EnvRunner env_;
  std::unordered_map<uint64_t, Episode> episodes_;        // by episode_key
  std::unordered_map<uint64_t, uint64_t> turn_requests_;  // a request of one sample -> its episode key
  std::unordered_map<int64_t, int64_t> starts_;           // per group: Start answers in
};

}  // namespace

SampleLoopDef multi_turn_loop() {
  SampleLoopDef d;
  d.make = [](const SampleLoopContext& c) -> std::unique_ptr<SampleLoop> { return std::make_unique<MultiTurnLoop>(c); };
  d.turns = true;
  d.needs_environment = true;
  d.summary = "an episode per sample with the environment (env.*), its observations between the model's turns";
  return d;
}

}  // namespace tiller::controller
