// The openai_agent sample loop (tiller/controller/agent.h, docs/agents.md): each sample is one call
// of the job's agent harness, which talks to the policy through an OpenAI-compatible endpoint at a
// base URL of the sample's own. The endpoint (engine/openai_server.h) renders chat requests with the
// model's chat template and hands each request to this loop's backend; the loop, on the
// controller's thread, checks that its prompt extends the sample's tokens so far, sends it to the
// sample's engine resuming the sample's parked session (only the new tokens are prefilled), and
// records what the engine sampled. The sample's response is every token after its first prompt:
// the model's turns (trained) and the harness's text between them (loss mask 0). A request whose
// prompt does not extend the tokens so far is retokenization drift, handled by agent.drift.
//
// Threading: the HTTP threads only queue requests (AgentShared::inbox, agent_sessions.h) and wait on
// their stream's box; the harness threads (HarnessPool) only run the harness; everything else runs
// on the controller's thread (start, generated, poll, drop), as sample_loop.h asks.
#include <algorithm>
#include <cmath>
#include <deque>
#include <mutex>
#include <random>
#include <unordered_map>

#include <fmt/format.h>

#include "controller/agent_sessions.h"
#include "controller/sample_loops.h"
#include "tiller/controller/agent.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/engine/openai_server.h"
#include "tiller/engine/server.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"

namespace tiller::controller {
namespace {

std::string random_hex(size_t bytes) {
  std::random_device rd;
  std::string out;
  for (size_t i = 0; i < bytes; ++i) out += fmt::format("{:02x}", rd() & 0xffu);
  return out;
}

class AgentLoop final : public SampleLoop {
 public:
  explicit AgentLoop(const SampleLoopContext& c)
      : host_(*c.host), ctx_(c), job_(*c.job), shared_(std::make_shared<AgentShared>()) {
    TILLER_CHECK(c.tokenizer && c.chat, "the openai_agent loop needs the job's tokenizer and chat template");
    TILLER_CHECK(c.n < 2048 && c.max_turns >= 1 && c.max_response_tokens >= 1, "openai_agent loop: bad sizes");
    harness_ = make_agent_harness(job_);
    pool_ = std::make_unique<HarnessPool>(harness_, static_cast<int>(job_.agent.concurrency));
    engine::OpenAiOptions o;
    o.host = job_.agent.host;
    o.port = static_cast<int>(job_.agent.port);
    o.token = random_hex(16);
    o.model_name = kModelName;
    o.request_timeout_s = job_.agent.timeout_s;
    o.tool_call_parser = job_.agent.tool_call_parser;
    o.max_n = 1;
    // Every harness running at once may have a request open (a few more for /tokenize and the like).
    o.threads = static_cast<int>(std::min<int64_t>(job_.agent.concurrency + 8, 4096));
    key_ = o.token;
    server_ = std::make_unique<engine::OpenAiServer>(agent_backend(shared_), c.tokenizer, *c.chat,
                                                     c.sampling.stop_token_ids,
                                                     c.max_prompt_tokens + c.max_response_tokens, o);
    base_ = fmt::format("http://{}:{}", job_.agent.host, server_->port());
    log::info("openai_agent: harness {}, endpoint {}/agents/<sample>/v1, drift policy {}", harness_->name(), base_,
              enum_name(job_.agent.drift));
  }

  // Every request still waiting is answered (503) first, so that the endpoint's threads, and the
  // harnesses waiting on them, end now rather than at their deadlines.
  ~AgentLoop() override {
    std::deque<Inbound> left;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->closed = true;
      shared_->routes.clear();
      left.swap(shared_->inbox);
    }
    refuse_all(left, "the run ended");
    for (auto& [key, s] : samples_)
      if (s.live && s.live_box) refuse(*s.live_box, s.live_endpoint_id, kUnavailable, "the run ended");
    server_->shutdown();
    pool_.reset();
  }

  void start(int64_t group) override {
    const data::Prompt& p = host_.prompt(group);
    for (int64_t j = 0; j < ctx_.n; ++j) {
      const uint64_t key = sample_key(group, j);
      Sample& s = samples_[key];
      s.group = group;
      s.sample = j;
      s.route = fmt::format("{}-{}-{}", random_hex(6), group, j);
      s.deadline = Deadline::after_seconds(job_.agent.timeout_s);
      routes_[s.route] = key;
      {
        std::lock_guard<std::mutex> lock(shared_->mu);
        shared_->routes.insert(s.route);
      }
      AgentTask t;
      t.base_url = fmt::format("{}/agents/{}/v1", base_, s.route);
      t.api_key = key_;
      t.model = kModelName;
      // Before the chat template: the harness makes its own messages (a prompt source that fills
      // only `text` made no chat template).
      t.prompt = p.input.empty() ? p.text : p.input;
      t.label = p.label;
      t.label_is_json = p.label_is_json;
      t.data_source = p.data_source;
      t.extra_info = p.extra_info;
      t.prompt_line = p.line;
      t.sample = j;
      t.step = host_.step();
      pool_->run(key, std::move(t), s.deadline);
    }
  }

  void generated(int64_t group, uint64_t request, engine::SampleOutput out) override {
    auto r = requests_.find(request);
    TILLER_CHECK(r != requests_.end(), "openai_agent: an answer to request {} of group {}, which it did not send",
                 request, group);
    const uint64_t key = r->second;
    requests_.erase(r);
    auto it = samples_.find(key);
    if (it == samples_.end()) return;  // dropped
    take_turn(it->second, std::move(out));
  }

  bool poll() override {
    bool any = false;
    std::deque<Inbound> in;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      in.swap(shared_->inbox);
    }
    while (!in.empty()) {
      any = true;
      try {
        in.front().abort ? take_abort(in.front()) : take_request(in.front());
      } catch (const std::exception& e) {
        refuse_all(in, e.what());  // this one and the rest: the job ends with the error
        throw;
      }
      in.pop_front();
    }
    for (HarnessPool::Result& r : pool_->take()) {
      any = true;
      take_outcome(r);
    }
    for (auto& [key, s] : samples_)
      if (!s.harness_done && s.deadline.expired())
        throw TimeoutError(fmt::format("{}: the agent harness {} did not return within agent.timeout_s = {} s (step {})",
                                       host_.where(s.group, s.sample), harness_->name(), job_.agent.timeout_s,
                                       host_.step()));
    return any;
  }

  void drop(int64_t group) override {
    for (int64_t j = 0; j < ctx_.n; ++j) {
      auto it = samples_.find(sample_key(group, j));
      if (it == samples_.end()) continue;
      Sample& s = it->second;
      if (s.live) {
        host_.abort(group, s.live_request);
        requests_.erase(s.live_request);
        refuse(*s.live_box, s.live_endpoint_id, kUnavailable, "the sample was dropped (too stale, or the run ends)");
      }
      if (s.has_parked) host_.release_session(group, s.parked);
      close_route(s.route);
      samples_.erase(it);
    }
  }

  int64_t waiting() const override {
    int64_t n = 0;
    for (const auto& [key, s] : samples_) n += s.live || s.harness_done ? 0 : 1;
    return n;
  }

 private:
  static constexpr const char* kModelName = "policy";

  struct Sample {
    int64_t group = 0, sample = 0;
    std::string route;
    Deadline deadline = Deadline::never();
    std::vector<int64_t> history;  // the first prompt and every token since: what the next prompt extends
    int64_t prompt_len = 0;        // 0 until the first request
    engine::SampleOutput out;      // every token after the prompt (the harness's with log-prob 0)
    TurnInfo info;
    engine::SessionKey parked{};
    bool has_parked = false;
    bool live = false;  // a request is on the engine
    uint64_t live_request = 0, live_endpoint_id = 0;
    std::shared_ptr<StreamBox> live_box;
    bool recording = true;  // false once dropped for drift: requests are served, not recorded
    bool dropped = false;
    bool harness_done = false;
    int64_t requests = 0, drifts = 0;
  };

  static void refuse_all(std::deque<Inbound>& in, const std::string& why) {
    for (Inbound& x : in)
      if (!x.abort) refuse(*x.box, x.endpoint_id, kUnavailable, why);
    in.clear();
  }

  static uint64_t sample_key(int64_t group, int64_t sample) {
    return (static_cast<uint64_t>(group) << 11) | static_cast<uint64_t>(sample);
  }

  void close_route(const std::string& route) {
    routes_.erase(route);
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->routes.erase(route);
  }

  void take_abort(const Inbound& x) {
    auto r = routes_.find(x.route);
    if (r == routes_.end()) return;
    Sample& s = samples_.at(r->second);
    if (!s.live || s.live_box != x.box || (x.endpoint_id != 0 && x.endpoint_id != s.live_endpoint_id)) return;
    // The harness gave up on the request: the engine stops it, and the turn is not recorded.
    host_.abort(s.group, s.live_request);
    requests_.erase(s.live_request);
    s.live = false;
    refuse(*s.live_box, s.live_endpoint_id, 1, "the request was cancelled");
    s.live_box.reset();
  }

  // The first position where `a` and `b` differ (their common length when one extends the other).
  static size_t first_difference(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
    const size_t n = std::min(a.size(), b.size());
    size_t i = 0;
    while (i < n && a[i] == b[i]) ++i;
    return i;
  }

  // The text of the tokens around `at` (8 either side), on one line (control characters escaped).
  std::string around(const std::vector<int64_t>& ids, size_t at) const {
    const size_t lo = at > 8 ? at - 8 : 0, hi = std::min(ids.size(), at + 8);
    const std::string text = ctx_.decode(std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(lo),
                                                              ids.begin() + static_cast<std::ptrdiff_t>(hi)));
    std::string out;
    for (char c : text) {
      if (c == '\n') out += "\\n";
      else if (c == '\r') out += "\\r";
      else if (c == '\t') out += "\\t";
      else if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
      else out += c;
    }
    return out;
  }

  void take_request(Inbound& x) {
    engine::Request& q = x.request;
    auto r = routes_.find(x.route);
    if (r == routes_.end()) {
      refuse(*x.box, x.endpoint_id, 5, "the agent session ended");
      return;
    }
    Sample& s = samples_.at(r->second);
    const std::string where = host_.where(s.group, s.sample);
    if (q.n != 1) return refuse(*x.box, x.endpoint_id, 3, "an agent session's requests take n = 1");
    if (s.live) return refuse(*x.box, x.endpoint_id, 3, "an agent session takes one request at a time");
    if (s.requests >= ctx_.max_turns)
      return refuse(*x.box, x.endpoint_id, 3,
                    fmt::format("the sample made rollout.max_turns = {} requests already", ctx_.max_turns));
    ++s.requests;
    std::vector<int64_t> prompt = std::move(q.prompt);
    bool fresh = s.prompt_len == 0 || !s.recording;
    if (!fresh) {
      const size_t at = first_difference(prompt, s.history);
      if (at < s.history.size()) {  // retokenization drift
        ++s.drifts;
        const std::string what = fmt::format(
            "{}: request {} of the agent harness does not extend the sample's tokens: it differs at token {} of {} "
            "(the sample has '{}', the request '{}')",
            where, s.requests, at, s.history.size(), around(s.history, at), around(prompt, at));
        // split and drop go on past a drift; its first place in the job is worth a look (the chat
        // template re-rendering a parsed tool call, say), so it is logged once at warning level.
        if (job_.agent.drift != AgentDrift::kError && !drift_reported_) {
          drift_reported_ = true;
          log::warn("{} (step {}); agent.drift = {} goes on; agent/drifts counts this job's drifts a step, the "
                    "rest are logged at debug level",
                    what, host_.step(), enum_name(job_.agent.drift));
        }
        switch (job_.agent.drift) {
          case AgentDrift::kError:
            throw Error(fmt::format("{} (step {}); agent.drift = split or drop goes on past it (docs/agents.md)", what,
                                    host_.step()));
          case AgentDrift::kSplit:
            if (static_cast<int64_t>(prompt.size()) <= ctx_.max_prompt_tokens) {
              log::debug("{}: a new segment", what);
              restart(s);
              fresh = true;
              break;
            }
            [[fallthrough]];  // a segment's prompt over max_prompt_tokens: the sample is dropped
          case AgentDrift::kDrop:
            log::debug("{}: dropped", what);
            if (s.has_parked) host_.release_session(s.group, s.parked);
            s.has_parked = false;
            s.recording = false;
            s.dropped = true;
            fresh = true;
            break;
        }
      }
    }
    int64_t room = ctx_.max_response_tokens - static_cast<int64_t>(s.out.tokens.size());
    if (s.recording && fresh) {
      if (static_cast<int64_t>(prompt.size()) > ctx_.max_prompt_tokens)
        return refuse(*x.box, x.endpoint_id, 3,
                      fmt::format("the sample's first prompt is {} tokens, over rollout.max_prompt_tokens = {}",
                                  prompt.size(), ctx_.max_prompt_tokens));
      s.history = prompt;
      s.prompt_len = static_cast<int64_t>(prompt.size());
      room = ctx_.max_response_tokens;
    } else if (s.recording) {
      // The harness's text since the last turn: in the response, masked out of the loss.
      const auto inserted = static_cast<int64_t>(prompt.size() - s.history.size());
      room -= inserted;
      if (room < 1)
        return refuse(*x.box, x.endpoint_id, 3,
                      fmt::format("the sample's response is at rollout.max_response_tokens = {}",
                                  ctx_.max_response_tokens));
      s.out.tokens.insert(s.out.tokens.end(), prompt.begin() + static_cast<std::ptrdiff_t>(s.history.size()),
                          prompt.end());
      s.out.logprobs.insert(s.out.logprobs.end(), static_cast<size_t>(inserted), 0.f);
      s.info.loss_mask.insert(s.info.loss_mask.end(), static_cast<size_t>(inserted), 0);
      s.history = prompt;
    }
    engine::Request e;
    e.prompt = std::move(prompt);
    e.n = 1;
    e.params = ctx_.sampling;  // the job's sampling, for on-policy log-probs; the request's own limits and stops on top
    e.params.max_new_tokens = std::min({ctx_.sampling.max_new_tokens, q.params.max_new_tokens, std::max<int64_t>(room, 1)});
    for (int64_t t : q.params.stop_token_ids)
      if (std::find(e.params.stop_token_ids.begin(), e.params.stop_token_ids.end(), t) == e.params.stop_token_ids.end())
        e.params.stop_token_ids.push_back(t);
    e.params.seed = host_.seed(s.group) + static_cast<uint64_t>(s.sample) +
                    static_cast<uint64_t>(s.requests - 1) * 0x9E3779B97F4A7C15ull;
    if (s.recording) {
      e.keep_session = true;
      e.resume = s.has_parked;
      e.session = s.parked;
      if (s.has_parked) host_.count_session_prefix(static_cast<int64_t>(s.history.size()) - 1);
      s.has_parked = false;  // the resume takes the session over
    }
    const uint64_t id = host_.generate(s.group, std::move(e), /*whole_group=*/false);
    requests_[id] = sample_key(s.group, s.sample);
    s.live = true;
    s.live_request = id;
    s.live_endpoint_id = x.endpoint_id;
    s.live_box = x.box;
  }

  // agent.drift = split: the sample starts over from the request's prompt.
  void restart(Sample& s) {
    if (s.has_parked) host_.release_session(s.group, s.parked);
    s.has_parked = false;
    s.out = {};
    s.info = {};
    s.history.clear();
    s.prompt_len = 0;
  }

  void take_turn(Sample& s, engine::SampleOutput o) {
    s.live = false;
    // The endpoint's answer: the choice's tokens, log-probs and finish (not the routes).
    engine::ClientResult answer_to_harness;
    engine::SampleOutput& a = answer_to_harness.sample;
    a.request_id = s.live_endpoint_id;
    a.tokens = o.tokens;
    a.logprobs = o.logprobs;
    a.finish_reason = o.finish_reason;
    a.prompt_tokens = o.prompt_tokens;
    if (!o.versions.empty()) answer_to_harness.weight_version = o.versions.back();
    if (s.recording) {
      // Routing replay: the request's prompt was the sample's history, so its routes cover every token.
      TILLER_CHECK(o.route_width == 0 || o.prompt_tokens == static_cast<int64_t>(s.history.size()),
                   "{}: a turn's routes start from a prompt of {} tokens, the history has {}",
                   host_.where(s.group, s.sample), o.prompt_tokens, s.history.size());
      append_turn(s.out, o);
      if (!o.tokens.empty()) {
        s.info.loss_mask.insert(s.info.loss_mask.end(), o.tokens.size(), 1);
        s.info.ends.push_back(static_cast<int64_t>(s.out.tokens.size()) - 1);
      }
      s.history.insert(s.history.end(), o.tokens.begin(), o.tokens.end());
      s.parked = {o.request_id, o.sample};
      s.has_parked = true;
    }
    std::shared_ptr<StreamBox> box = std::move(s.live_box);
    answer(*box, std::move(answer_to_harness));
  }

  void take_outcome(HarnessPool::Result& r) {
    auto it = samples_.find(r.key);
    if (it == samples_.end()) return;  // its group was dropped
    Sample& s = it->second;
    const std::string where = fmt::format("{}, step {}", host_.where(s.group, s.sample), host_.step());
    if (!r.error.empty()) throw Error(fmt::format("{} ({})", r.error, where));
    s.harness_done = true;
    if (s.live) {  // returned with a request still on the engine: it is not part of the sample
      host_.abort(s.group, s.live_request);
      requests_.erase(s.live_request);
      refuse(*s.live_box, s.live_endpoint_id, 1, "the harness returned");
      s.live = false;
    }
    if (s.has_parked) host_.release_session(s.group, s.parked);
    close_route(s.route);
    if (s.prompt_len == 0 || s.info.ends.empty())
      throw Error(fmt::format("{}: the agent harness {} returned without a request to the policy that was answered "
                              "({})",
                              host_.where(s.group, s.sample), harness_->name(), where));
    if (job_.reward.type == RewardType::kEnv && !r.outcome.reward)
      throw Error(fmt::format("{}: reward.type = env takes the agent harness's reward, and {} returned None ({})",
                              host_.where(s.group, s.sample), harness_->name(), where));
    if (r.outcome.reward && !std::isfinite(*r.outcome.reward))
      throw Error(fmt::format("{}: the agent harness {} returned the reward {}, not a finite number ({})",
                              host_.where(s.group, s.sample), harness_->name(), *r.outcome.reward, where));
    FinishedSample f;
    f.sample = s.sample;
    f.prompt.assign(s.history.begin(), s.history.begin() + s.prompt_len);
    f.out = std::move(s.out);
    f.out.sample = s.sample;
    f.out.prompt_tokens = s.prompt_len;
    // The response ends with the model's last turn: what the harness sent after it is not trained.
    const auto keep = static_cast<size_t>(s.info.ends.back() + 1);
    f.out.tokens.resize(keep);
    f.out.logprobs.resize(keep);
    s.info.loss_mask.resize(keep);
    f.out.finish_reason = f.out.finish_reason == "length" ? "length" : "stop";
    s.info.rewards.assign(s.info.ends.size(), 0.f);
    if (r.outcome.reward) s.info.rewards.back() = static_cast<float>(*r.outcome.reward);
    if (s.dropped) std::fill(s.info.loss_mask.begin(), s.info.loss_mask.end(), 0);
    f.turns = std::move(s.info);
    f.env_seconds = r.seconds;
    f.env_calls = s.requests;
    f.drifts = s.drifts;
    const int64_t group = s.group;
    samples_.erase(it);
    host_.finish(group, std::move(f));
  }

  LoopHost& host_;
  SampleLoopContext ctx_;
  const JobConfig& job_;
  std::shared_ptr<AgentShared> shared_;
  std::shared_ptr<AgentHarness> harness_;
  std::unique_ptr<HarnessPool> pool_;
  std::unique_ptr<engine::OpenAiServer> server_;
  std::string base_, key_;
  bool drift_reported_ = false;                          // the job's first drift was logged
  std::unordered_map<uint64_t, Sample> samples_;        // by sample_key
  std::unordered_map<std::string, uint64_t> routes_;    // route -> sample_key
  std::unordered_map<uint64_t, uint64_t> requests_;     // engine request id -> sample_key
};

}  // namespace

SampleLoopDef openai_agent_loop() {
  SampleLoopDef d;
  d.make = [](const SampleLoopContext& c) -> std::unique_ptr<SampleLoop> { return std::make_unique<AgentLoop>(c); };
  d.turns = true;
  d.summary = "an agent harness (agent.harness) per sample, talking to the policy through an OpenAI-compatible "
              "endpoint; its conversation recorded token for token";
  return d;
}

}  // namespace tiller::controller
