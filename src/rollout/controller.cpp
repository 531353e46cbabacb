#include "rollout/controller.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <deque>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "rollout/engine_pool.h"
#include "rollout/protocol.h"
#include "rollout/role_worker.h"
#include "tiller/algo/algo.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/core/logging.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/model/chat_template.h"
#include "tiller/model/model_config.h"
#include "tiller/model/tokenizer.h"
#include "tiller/reward/remote_reward.h"
#include "tiller/reward/rule_reward.h"
#include "tiller/rollout/experience.h"
#include "tiller/rollout/metrics.h"
#include "tiller/rollout/packer.h"
#include "tiller/rollout/prompt_dataset.h"
#include "tiller/sync/bucket_plan.h"
#include "tiller/zero/optimizer.h"

namespace tiller::rollout {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

std::atomic<bool> g_stop{false};

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
double wall_us() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

const std::vector<std::string> kRoleOrder = {"actor", "ref", "critic", "reward"};

// The ranks of one role group and the roles colocated with it: they share processes, so they
// take the same messages.
struct TrainerGroup {
  std::vector<int> ranks;
  std::vector<std::string> roles;  // in kRoleOrder
  bool has(const std::string& r) const { return std::find(roles.begin(), roles.end(), r) != roles.end(); }
  std::string name() const { return fmt::format("{}", fmt::join(roles, "+")); }
};

std::vector<TrainerGroup> trainer_groups(const dist::RankPlan& plan) {
  std::vector<TrainerGroup> out;
  std::map<std::string, size_t> host_of;
  for (const auto& g : plan.groups)
    if (g.colocated_with.empty()) {
      host_of[g.role] = out.size();
      out.push_back({g.ranks, {g.role}});
    }
  for (const auto& g : plan.groups)
    if (!g.colocated_with.empty()) out.at(host_of.at(g.colocated_with)).roles.push_back(g.role);
  for (auto& g : out) {
    std::vector<std::string> sorted;
    for (const auto& r : kRoleOrder)
      if (g.has(r)) sorted.push_back(r);
    g.roles = sorted;
  }
  return out;
}

// "3", "3,5", "3-5" -> the set of steps.
std::set<int64_t> parse_steps(const std::string& spec) {
  std::set<int64_t> out;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    const std::string part = spec.substr(pos, end - pos);
    try {
      const size_t dash = part.find('-');
      if (dash == std::string::npos) {
        out.insert(std::stoll(part));
      } else {
        const int64_t a = std::stoll(part.substr(0, dash)), b = std::stoll(part.substr(dash + 1));
        if (b < a || b - a > 100000) throw std::invalid_argument("range");
        for (int64_t s = a; s <= b; ++s) out.insert(s);
      }
    } catch (const std::logic_error&) {
      throw ConfigError(fmt::format("logging.profile_steps = '{}': use step numbers like \"3\", \"3,5\" or \"3-5\"",
                                    spec));
    }
    pos = end + 1;
  }
  return out;
}

at::Tensor as_tensor(std::vector<float>& v) {
  return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::kFloat);
}

struct Moments {
  double mean = 0, std = 0, min = 0, max = 0;
};
Moments moments(const at::Tensor& t) {
  if (t.numel() == 0) return {};
  const at::Tensor d = t.to(at::kDouble);
  return {d.mean().item<double>(), t.numel() > 1 ? d.std().item<double>() : 0.0, d.min().item<double>(),
          d.max().item<double>()};
}

std::string hms(double s) {
  const auto t = static_cast<int64_t>(std::max(0.0, s));
  return fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60);
}

}  // namespace

void request_stop() { g_stop = true; }
bool stop_requested() { return g_stop; }

struct Controller::Impl {
  const JobConfig& cfg;
  const dist::RankPlan& plan;
  dist::Communicator& world;
  ControllerOptions opts;

  std::vector<TrainerGroup> groups;
  const TrainerGroup* actor_group = nullptr;
  const TrainerGroup* critic_group = nullptr;
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::unique_ptr<PromptDataset> dataset;
  std::vector<int64_t> stop_ids;
  reward::RewardFn rule;
  std::unique_ptr<reward::RemoteReward> remote;
  std::unique_ptr<EnginePool> engines;
  uint64_t plan_id = 0;

  // Run state (what a checkpoint keeps).
  int64_t step = 0;             // completed PPO steps
  uint64_t version = 0;         // the engines' weight version (number of syncs)
  int64_t actor_updates = 0, critic_updates = 0;  // optimizer steps
  algo::KlController kl_ctl;
  algo::RunningMoments reward_moments;

  // Outputs.
  std::string ckpt_root;
  std::unique_ptr<JsonlWriter> jsonl;
  std::unique_ptr<TensorBoardWriter> tensorboard;
  std::set<int64_t> profile_steps;
  std::string trace_path;
  json trace_events = json::array();
  int64_t opt_steps_per_step = 1;
  zero::LrSchedule actor_lr, critic_lr;

  // This step.
  Rollout ro;
  std::vector<int64_t> step_prompts;  // dataset indices of the step's prompts
  std::map<std::string, double> seconds;  // phase -> seconds
  double entropy_sum = 0;
  int64_t entropy_tokens = 0;
  std::vector<std::vector<dist::WorkPtr>> sends;  // kept until the peers answered

  Impl(const JobConfig& c, const dist::RankPlan& p, dist::Communicator& w, ControllerOptions o)
      : cfg(c), plan(p), world(w), opts(std::move(o)), kl_ctl(c.algo.kl_coef, c.algo.target_kl, c.algo.kl_horizon) {
    groups = trainer_groups(plan);
    for (const auto& g : groups) {
      if (g.has("actor")) actor_group = &g;
      if (g.has("critic")) critic_group = &g;
    }
    TILLER_CHECK(actor_group != nullptr, "the rank plan has no actor group");
    const std::string actor_dir = cfg.roles.actor.model;
    tokenizer = model::load_tokenizer(actor_dir);
    stop_ids = model::eos_token_ids(actor_dir, model::load_model_config(actor_dir), *tokenizer);
    DatasetOptions d;
    d.input_key = cfg.data.input_key;
    d.label_key = cfg.data.label_key;
    d.input_template = cfg.data.input_template;
    d.chat = cfg.data.apply_chat_template ? model::parse_chat_format("auto", *tokenizer) : model::ChatFormat::kNone;
    d.max_prompt_tokens = cfg.rollout.max_prompt_tokens;
    d.long_prompts = parse_long_prompt_policy(cfg.data.long_prompt_policy);
    d.shuffle = cfg.data.shuffle;
    d.seed = static_cast<uint64_t>(cfg.run.seed);
    d.max_samples = cfg.data.max_samples;
    if (cfg.data.prompts.empty()) throw ConfigError("data.prompts: set the JSONL file of prompts");
    dataset = std::make_unique<PromptDataset>(cfg.data.prompts, *tokenizer, d);
    if (dataset->skipped() > 0)
      log::warn("data: {} of {} prompts are longer than rollout.max_prompt_tokens = {} and are skipped "
                "(data.long_prompt_policy = skip)",
                dataset->skipped(), dataset->skipped() + dataset->size(), cfg.rollout.max_prompt_tokens);
    if (cfg.reward.type == "rule") rule = reward::find(cfg.reward.rule);
    if (cfg.reward.type == "remote") {
      reward::RemoteOptions ro;
      ro.address = cfg.reward.remote_address;
      ro.timeout_seconds = cfg.reward.remote_timeout_s;
      ro.retries = static_cast<int>(cfg.reward.remote_retries);
      ro.batch_size = static_cast<int>(cfg.reward.remote_batch_size);
      ro.concurrency = static_cast<int>(cfg.reward.remote_concurrency);
      remote = std::make_unique<reward::RemoteReward>(ro);
      const std::string name = remote->check_health(Deadline::after_seconds(cfg.timeouts.startup_s));
      log::info("reward: the remote service at {} scores '{}'", ro.address, name);
    }

    engines = std::make_unique<EnginePool>(opts.engine_addresses, opts.engine_token, cfg.timeouts.rpc_s);
    if (engines->size() == 0) throw ConfigError("engines.count = 0: tiller train needs at least one engine");
    const model::ModelConfig mc = model::load_model_config(actor_dir);
    const sync::BucketPlan bp =
        sync::make_bucket_plan(mc, static_cast<int>(actor_group->ranks.size()), static_cast<int>(cfg.engines.tp),
                               cfg.roles.actor.dtype == "bf16" ? "bf16" : "fp32", cfg.engines.sync_bucket_mb << 20);
    const std::string plan_json = bp.to_json();
    for (size_t i = 0; i < engines->size(); ++i) plan_id = engines->client(i).install_sync_plan(plan_json);

    const int64_t samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt;
    opt_steps_per_step = samples / cfg.train.train_batch_size * cfg.algo.ppo_epochs;
    actor_lr = zero::LrSchedule::from_config(cfg.train);
    actor_lr.total_steps = std::max<int64_t>(1, (cfg.train.num_steps - cfg.train.critic_warmup_steps) * opt_steps_per_step);
    critic_lr = actor_lr;
    critic_lr.total_steps = std::max<int64_t>(1, cfg.train.num_steps * opt_steps_per_step);

    const std::string out = cfg.run.output_dir;
    ckpt_root = cfg.checkpoint.dir;
    jsonl = std::make_unique<JsonlWriter>(cfg.logging.metrics_jsonl.empty() ? out + "/metrics.jsonl"
                                                                            : cfg.logging.metrics_jsonl);
    tensorboard = std::make_unique<TensorBoardWriter>(cfg.logging.tensorboard_dir.empty() ? out + "/tensorboard"
                                                                                          : cfg.logging.tensorboard_dir);
    profile_steps = parse_steps(cfg.logging.profile_steps);
    trace_path = cfg.logging.chrome_trace.empty() ? out + "/trace.json" : cfg.logging.chrome_trace;
  }

  // --- messages ---------------------------------------------------------------------------------

  void post(int rank, const Message& m) { sends.push_back(send_message(world, rank, m)); }

  Message answer(int rank, double timeout_s, const char* what) {
    Message m = recv_message(world, rank, Deadline::after_seconds(timeout_s));
    check_answer(rank, m, what);
    return m;
  }

  void check_answer(int rank, const Message& m, const char* what) const {
    if (m.text.rfind("error: ", 0) == 0)
      throw Error(fmt::format("rank {} ({}) failed during {}: {}", rank, plan.ranks.at(rank).label(), what,
                              m.text.substr(7)));
  }

  // Every trainer rank once (colocated roles share a rank).
  std::set<int> trainer_ranks() const {
    std::set<int> ranks;
    for (const auto& g : groups) ranks.insert(g.ranks.begin(), g.ranks.end());
    return ranks;
  }

  // Sends `m` to every trainer rank and waits for each answer.
  void call_trainers(const Message& m, double timeout_s, const char* what) {
    const std::set<int> ranks = trainer_ranks();
    for (int r : ranks) post(r, m);
    for (int r : ranks) answer(r, timeout_s, what);
    settle_sends();
  }

  void settle_sends() {
    for (auto& v : sends)
      for (auto& w : v) w->wait(Deadline::after_seconds(cfg.timeouts.collective_s));
    sends.clear();
  }

  // A micro-batch of `samples` with its sequences, lengths and prompt lengths.
  Message batch_message(Op op, const std::vector<int64_t>& samples) const {
    int64_t total = 0;
    for (int64_t s : samples) total += ro.seq_len(s);
    const int64_t n = static_cast<int64_t>(samples.size());
    at::Tensor tokens = at::empty({total}, at::kLong), seq_lens = at::empty({n}, at::kLong),
               prompt_lens = at::empty({n}, at::kLong);
    int64_t* tp = tokens.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = samples[static_cast<size_t>(i)];
      const auto b = ro.tokens.begin() + ro.seq_offset[s];
      tp = std::copy(b, b + ro.seq_len(s), tp);
      seq_lens.data_ptr<int64_t>()[i] = ro.seq_len(s);
      prompt_lens.data_ptr<int64_t>()[i] = ro.prompt_len[s];
    }
    Message m;
    m.op = op;
    m.tensors = {tokens, seq_lens, prompt_lens};
    return m;
  }

  // Per-response-token values of `samples`, concatenated.
  at::Tensor gather(const std::vector<float>& v, const std::vector<int64_t>& samples) const {
    std::vector<float> out;
    for (int64_t s : samples) {
      const auto b = v.begin() + ro.resp_offset[s];
      out.insert(out.end(), b, b + ro.response_len[s]);
    }
    return at::tensor(out, at::kFloat);
  }
  void scatter(std::vector<float>& v, const std::vector<int64_t>& samples, const at::Tensor& t) const {
    const float* p = t.data_ptr<float>();
    int64_t i = 0;
    for (int64_t s : samples) {
      std::copy(p + i, p + i + ro.response_len[s], v.begin() + ro.resp_offset[s]);
      i += ro.response_len[s];
    }
    TILLER_CHECK(i == t.numel(), "an answer carries {} values for {} response tokens", t.numel(), i);
  }

  // --- scoring rounds ---------------------------------------------------------------------------

  struct PendingRound {
    Round round;
    std::vector<std::unique_ptr<IncomingMessage>> replies;
    std::vector<bool> done;
  };
  struct ScoreState {
    const TrainerGroup* group;
    StreamingPacker packer;
    std::deque<PendingRound> rounds;
  };

  void send_round(ScoreState& st, Round round) {
    const double temperature = cfg.rollout.temperature > 0 ? cfg.rollout.temperature : 1.0;
    for (size_t k = 0; k < round.size(); ++k) {
      Message m = batch_message(Op::kScore, round[k]);
      m.scalars = {temperature};
      post(st.group->ranks[k], m);
    }
    PendingRound p;
    p.round = std::move(round);
    p.replies.resize(p.round.size());
    p.done.assign(p.round.size(), false);
    st.rounds.push_back(std::move(p));
  }

  // Takes every answer that has arrived; true when this group has no round outstanding.
  bool poll_rounds(ScoreState& st) {
    while (!st.rounds.empty()) {
      PendingRound& p = st.rounds.front();
      bool all = true;
      for (size_t k = 0; k < p.round.size(); ++k) {
        if (p.done[k]) continue;
        const int rank = st.group->ranks[k];
        if (!p.replies[k]) p.replies[k] = std::make_unique<IncomingMessage>(world, rank);
        if (!p.replies[k]->poll()) {
          all = false;
          continue;
        }
        const Message m = p.replies[k]->take();
        check_answer(rank, m, "scoring");
        take_scores(*st.group, p.round[k], m);
        p.done[k] = true;
      }
      if (!all) return false;
      st.rounds.pop_front();
    }
    return true;
  }

  void take_scores(const TrainerGroup& g, const std::vector<int64_t>& samples, const Message& m) {
    size_t t = 0;
    for (size_t r = 0; r < g.roles.size(); ++r) {
      const std::string& role = g.roles[r];
      seconds["score." + role] += m.scalars.at(r);
      if (role == "actor") {
        scatter(ro.logp, samples, m.tensors.at(t++));
        const at::Tensor ent = m.tensors.at(t++);
        entropy_sum += ent.sum().item<double>();
        entropy_tokens += ent.numel();
      } else if (role == "ref") {
        scatter(ro.ref_logp, samples, m.tensors.at(t++));
      } else if (role == "critic") {
        scatter(ro.values, samples, m.tensors.at(t++));
      } else {
        const at::Tensor sc = m.tensors.at(t++).contiguous();
        TILLER_CHECK(sc.numel() == static_cast<int64_t>(samples.size()), "the reward role answered {} scores for {} samples",
                     sc.numel(), samples.size());
        const float* p = sc.data_ptr<float>();
        for (size_t i = 0; i < samples.size(); ++i) ro.score[samples[i]] = p[i];
      }
    }
  }

  // --- one step ---------------------------------------------------------------------------------

  json metrics;  // this step's

  void generate_and_score() {
    const int64_t n = cfg.rollout.n_samples_per_prompt;
    step_prompts = dataset->next(cfg.rollout.batch_size);
    ro.clear();
    entropy_sum = 0;
    entropy_tokens = 0;
    std::deque<ScoreState> states;
    for (const auto& g : groups)
      states.push_back({&g, StreamingPacker(static_cast<int>(g.ranks.size()), cfg.rollout.micro_batch_tokens), {}});

    const auto t0 = Clock::now();
    const double w0 = wall_us();
    const Deadline deadline = Deadline::after_seconds(cfg.timeouts.generate_s);
    engines->begin(deadline);
    if (remote) remote->begin_step(static_cast<uint64_t>(step + 1));
    const int64_t cap = cfg.engines.max_num_seqs * 2;  // samples queued per engine beyond which dispatch waits
    size_t next_prompt = 0;
    int64_t expected = static_cast<int64_t>(step_prompts.size()) * n, received = 0;
    double gen_seconds = 0;
    int64_t gen_tokens = 0;
    std::vector<double> engine_busy(engines->size(), 0.0);
    while (received < expected) {
      while (next_prompt < step_prompts.size()) {
        int64_t least = engines->in_flight(0);
        for (size_t i = 1; i < engines->size(); ++i) least = std::min(least, engines->in_flight(i));
        if (least >= cap) break;
        const Prompt& p = dataset->at(step_prompts[next_prompt]);
        engine::Request r;
        r.id = next_prompt;
        r.prompt = p.tokens;
        r.n = n;
        r.params.greedy = cfg.rollout.temperature == 0;
        r.params.temperature = cfg.rollout.temperature > 0 ? cfg.rollout.temperature : 1.0;
        r.params.top_p = cfg.rollout.top_p > 0 ? cfg.rollout.top_p : 1.0;
        r.params.top_k = cfg.rollout.top_k > 0 ? cfg.rollout.top_k : 0;
        r.params.max_new_tokens = cfg.rollout.max_new_tokens;
        r.params.stop_token_ids = stop_ids;
        r.params.seed = static_cast<uint64_t>(cfg.run.seed) * 1000003ull + static_cast<uint64_t>(step) * 65537ull +
                        next_prompt * static_cast<uint64_t>(n);
        engines->dispatch(r, version);
        ++next_prompt;
      }
      Completion c;
      if (engines->pop(c, 2)) {
        if (!c.failure.empty()) throw CommError("generation failed: " + c.failure);
        if (c.result.error_code != 0)
          throw Error(fmt::format("engine {} refused prompt {} (line {} of {}): {}", c.engine, c.result.sample.request_id,
                                  dataset->at(step_prompts.at(c.result.sample.request_id)).line, cfg.data.prompts,
                                  c.result.error));
        const engine::SampleOutput& s = c.result.sample;
        const int64_t slot = static_cast<int64_t>(s.request_id);
        const Prompt& p = dataset->at(step_prompts.at(static_cast<size_t>(slot)));
        const int64_t id = ro.add(slot, s.sample, p.tokens, s.tokens, s.logprobs, s.finish_reason == "length");
        gen_tokens += static_cast<int64_t>(s.tokens.size());
        if (rule) {
          reward::Sample rs{p.text, tokenizer->decode(s.tokens, true), p.label};
          ro.score[id] = static_cast<float>(rule(rs));
        } else if (remote) {
          reward::RemoteSample rs;
          rs.id = static_cast<uint64_t>(id);
          rs.prompt = p.text;
          rs.response = tokenizer->decode(s.tokens, true);
          rs.label = p.label;
          rs.finish_reason = s.finish_reason;
          rs.prompt_index = static_cast<uint64_t>(p.line);
          rs.sample_index = static_cast<uint32_t>(s.sample);
          rs.response_tokens = static_cast<int64_t>(s.tokens.size());
          remote->add(std::move(rs));
        }
        for (auto& st : states) st.packer.add(id, ro.seq_len(id));
        ++received;
        if (received == expected) gen_seconds = since(t0);
      } else if (deadline.expired()) {
        throw TimeoutError(fmt::format("generation: {} of {} samples after timeouts.generate_s = {} s", received,
                                       expected, cfg.timeouts.generate_s));
      }
      for (auto& st : states)
        while (auto round = st.packer.next_round(received == expected)) send_round(st, std::move(*round));
      for (auto& st : states) poll_rounds(st);
    }
    engines->end();
    trace_span("generate", -1, w0, wall_us());
    const double w1 = wall_us();
    const Deadline score_deadline = Deadline::after_seconds(cfg.timeouts.collective_s + cfg.timeouts.generate_s);
    auto backoff = std::chrono::microseconds(50);
    for (;;) {
      bool all = true;
      for (auto& st : states) all = poll_rounds(st) && all;
      if (all) break;
      if (score_deadline.expired())
        throw TimeoutError("scoring: the trainer ranks did not answer within timeouts.collective_s + generate_s");
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::microseconds(2000));
    }
    settle_sends();
    if (remote) {
      for (const auto& [id, score] : remote->finish(Deadline::after_seconds(cfg.timeouts.generate_s)))
        ro.score[static_cast<size_t>(id)] = static_cast<float>(score);
      const reward::RemoteStats rs = remote->take_stats();
      metrics["reward/remote_calls"] = rs.calls;
      metrics["reward/remote_retries"] = rs.retries;
      metrics["reward/remote_seconds_per_call"] = rs.calls > 0 ? rs.call_seconds / static_cast<double>(rs.calls) : 0.0;
    }
    trace_span("score (after generation)", -1, w1, wall_us());
    seconds["generate"] = gen_seconds;
    seconds["score_tail"] = since(t0) - gen_seconds;  // scoring left after the last completion
    metrics["throughput/generate_tokens_per_s"] = gen_seconds > 0 ? gen_tokens / gen_seconds : 0;
  }

  // Rewards, KL and advantages on the host.
  void advantages() {
    const auto t0 = Clock::now();
    const int64_t b = ro.size(), n = cfg.rollout.n_samples_per_prompt;
    std::vector<int64_t> cu_v(ro.resp_offset);
    cu_v.push_back(ro.response_tokens());
    const at::Tensor cu = at::tensor(cu_v, at::kLong);
    at::Tensor logp = as_tensor(ro.logp), ref = as_tensor(ro.ref_logp);
    const bool have_ref = plan.group("ref") != nullptr;
    const double coef = kl_ctl.value();
    const algo::KlEstimator est = algo::parse_kl_estimator(cfg.algo.kl_estimator);
    at::Tensor kl = have_ref ? algo::kl_estimate(logp, ref, est) : at::zeros_like(logp);
    at::Tensor scores = at::tensor(ro.score, at::kFloat);
    const Moments raw = moments(scores);
    scores = algo::clip_rewards(scores, cfg.reward.clip);
    if (cfg.reward.normalize) {
      reward_moments.update(scores);
      scores = reward_moments.normalize(scores);
    }
    const double kl_reward_coef = cfg.algo.kl_in_reward ? coef : 0.0;
    const std::string& e = cfg.algo.advantage_estimator;
    at::Tensor adv, ret;
    if (e == "gae") {
      const at::Tensor rewards = algo::token_rewards(scores, kl, cu, kl_reward_coef);
      auto ar = algo::gae(rewards, as_tensor(ro.values), cu, cfg.algo.gamma, cfg.algo.lambd);
      adv = ar.advantages;
      ret = ar.returns;
    } else if (e == "reinforce") {
      const at::Tensor rewards = algo::token_rewards(scores, kl, cu, kl_reward_coef);
      adv = algo::discounted_returns(rewards, cu, cfg.algo.gamma);
      ret = adv;
    } else {
      // Group baselines over the n samples of each prompt, in (prompt, sample) order.
      std::vector<int64_t> by_slot(static_cast<size_t>(b));
      for (int64_t s = 0; s < b; ++s) by_slot[static_cast<size_t>(ro.prompt[s] * n + ro.sample[s])] = s;
      const at::Tensor order = at::tensor(by_slot, at::kLong);
      const algo::GroupBaseline kind = e == "rloo"                 ? algo::GroupBaseline::kRloo
                                       : e == "group_norm"         ? algo::GroupBaseline::kMeanStd
                                                                   : algo::GroupBaseline::kMean;
      at::Tensor grouped = algo::group_advantages(scores.index_select(0, order), n, kind);
      at::Tensor per_sample = at::empty_like(grouped);
      per_sample.index_copy_(0, order, grouped);
      adv = algo::per_token(per_sample, cu);
      if (kl_reward_coef > 0)
        adv = adv + algo::discounted_returns(algo::token_rewards(at::zeros_like(scores), kl, cu, kl_reward_coef), cu,
                                             cfg.algo.gamma);
      ret = adv;
    }
    const Moments adv_raw = moments(adv);
    if (cfg.algo.whiten_advantages && e != "group_norm" && e != "dr_grpo") adv = algo::whiten(adv);
    std::copy(adv.data_ptr<float>(), adv.data_ptr<float>() + adv.numel(), ro.advantages.begin());
    const at::Tensor retc = ret.contiguous();
    std::copy(retc.data_ptr<float>(), retc.data_ptr<float>() + retc.numel(), ro.returns.begin());

    // Metrics of the rollout.
    const double mean_kl = ro.response_tokens() > 0 ? kl.sum().item<double>() / b : 0.0;  // per sample
    const Moments lens = moments(at::tensor(ro.response_len, at::kLong));
    const Moments plen = moments(at::tensor(ro.prompt_len, at::kLong));
    metrics["reward/mean"] = raw.mean;
    metrics["reward/std"] = raw.std;
    metrics["reward/min"] = raw.min;
    metrics["reward/max"] = raw.max;
    metrics["kl/mean_per_sample"] = mean_kl;
    metrics["kl/coef"] = coef;
    metrics["entropy"] = entropy_tokens > 0 ? entropy_sum / entropy_tokens : 0.0;
    metrics["advantages/mean"] = adv_raw.mean;
    metrics["advantages/std"] = adv_raw.std;
    metrics["advantages/min"] = adv_raw.min;
    metrics["advantages/max"] = adv_raw.max;
    metrics["returns/mean"] = moments(ret).mean;
    if (critic_group) metrics["values/mean"] = moments(as_tensor(ro.values)).mean;
    metrics["response_length/mean"] = lens.mean;
    metrics["response_length/max"] = lens.max;
    metrics["prompt_length/mean"] = plen.mean;
    double truncated = 0;
    for (uint8_t t : ro.truncated) truncated += t;
    metrics["response_length/truncated_fraction"] = b > 0 ? truncated / b : 0.0;
    kl_ctl.update(mean_kl, b);
    seconds["advantage"] = since(t0);
  }

  void train() {
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    const bool train_actor = step + 1 > cfg.train.critic_warmup_steps;
    const bool dr_grpo = cfg.algo.advantage_estimator == "dr_grpo";
    const bool kl_loss = !cfg.algo.kl_in_reward && plan.group("ref") != nullptr && kl_ctl.value() > 0;
    const bool tis = cfg.algo.tis_cap > 0;
    const std::vector<int64_t> lens = ro.seq_lens();
    std::mt19937_64 rng(static_cast<uint64_t>(cfg.run.seed) * 7919ull + static_cast<uint64_t>(step));
    std::map<std::string, std::array<double, kStepStatCount>> totals;
    std::map<std::string, double> steps_done;
    // Samples are numbered in arrival order, which timing decides; the optimizer steps take them
    // in (prompt, sample) order shuffled by the seed, so a run's mini-batches do not depend on it.
    std::vector<int64_t> canonical(static_cast<size_t>(ro.size()));
    std::iota(canonical.begin(), canonical.end(), 0);
    std::sort(canonical.begin(), canonical.end(), [&](int64_t a, int64_t b) {
      return std::make_pair(ro.prompt[a], ro.sample[a]) < std::make_pair(ro.prompt[b], ro.sample[b]);
    });
    for (int64_t epoch = 0; epoch < cfg.algo.ppo_epochs; ++epoch) {
      std::vector<int64_t> order = canonical;
      std::shuffle(order.begin(), order.end(), rng);
      for (size_t start = 0; start < order.size(); start += static_cast<size_t>(cfg.train.train_batch_size)) {
        const std::vector<int64_t> chunk(order.begin() + static_cast<std::ptrdiff_t>(start),
                                         order.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                             order.size(), start + cfg.train.train_batch_size)));
        int64_t tokens = 0;
        for (int64_t s : chunk) tokens += ro.response_len[s];
        const double normalizer = dr_grpo ? static_cast<double>(chunk.size() * cfg.rollout.max_new_tokens)
                                           : static_cast<double>(std::max<int64_t>(tokens, 1));
        struct Plan {
          const TrainerGroup* group;
          bool actor;
          std::vector<Round> rounds;
        };
        std::vector<Plan> plans;
        if (train_actor)
          plans.push_back({actor_group, true,
                           plan_rounds(chunk, lens, static_cast<int>(actor_group->ranks.size()),
                                       cfg.train.micro_batch_tokens)});
        if (critic_group)
          plans.push_back({critic_group, false,
                           plan_rounds(chunk, lens, static_cast<int>(critic_group->ranks.size()),
                                       cfg.train.micro_batch_tokens)});
        // Actor and critic rounds interleaved: on different ranks they compute at the same time.
        size_t rounds = 0;
        for (const auto& p : plans) rounds = std::max(rounds, p.rounds.size());
        for (size_t r = 0; r < rounds; ++r)
          for (const auto& p : plans) {
            if (r >= p.rounds.size()) continue;
            for (size_t k = 0; k < p.rounds[r].size(); ++k) {
              const auto& mb = p.rounds[r][k];
              Message m = batch_message(p.actor ? Op::kTrainActor : Op::kTrainCritic, mb);
              if (p.actor) {
                m.tensors.push_back(gather(ro.logp, mb));
                m.tensors.push_back(gather(ro.advantages, mb));
                m.tensors.push_back(kl_loss ? gather(ro.ref_logp, mb) : at::empty({0}, at::kFloat));
                m.tensors.push_back(tis ? gather(ro.engine_logp, mb) : at::empty({0}, at::kFloat));
                m.scalars = {normalizer, kl_loss ? kl_ctl.value() : 0.0};
              } else {
                m.tensors.push_back(gather(ro.values, mb));
                m.tensors.push_back(gather(ro.returns, mb));
                m.scalars = {normalizer};
              }
              post(p.group->ranks[k], m);
            }
          }
        for (const auto& p : plans) {
          Message m;
          m.op = p.actor ? Op::kStepActor : Op::kStepCritic;
          const double lr = p.actor ? cfg.train.actor_lr * actor_lr.factor(actor_updates)
                                    : cfg.train.critic_lr * critic_lr.factor(critic_updates);
          m.scalars = {lr};
          for (int rank : p.group->ranks) post(rank, m);
          metrics[p.actor ? "actor/lr" : "critic/lr"] = lr;
        }
        for (const auto& p : plans) {
          const std::string role = p.actor ? "actor" : "critic";
          auto& tot = totals[role];
          const double ranks = static_cast<double>(p.group->ranks.size());
          for (int rank : p.group->ranks) {
            const Message a = answer(rank, cfg.timeouts.train_s, p.actor ? "the actor's update" : "the critic's update");
            for (int i : {kLoss, kClipTokens, kApproxKlTokens, kEntropySum, kTokens}) tot[i] += a.scalars.at(i);
            tot[kTrainSeconds] += a.scalars.at(kTrainSeconds) / ranks;
            tot[kStepSeconds] += a.scalars.at(kStepSeconds) / ranks;
            tot[kGradNorm] = a.scalars.at(kGradNorm);
            tot[kSkipped] += a.scalars.at(kSkipped) / ranks;
            tot[kPeakMb] = std::max(tot[kPeakMb], a.scalars.at(kPeakMb));
          }
          steps_done[role] += 1;
          (p.actor ? actor_updates : critic_updates) += 1;
        }
        settle_sends();
      }
    }
    for (auto& [role, t] : totals) {
      const double updates = std::max(1.0, steps_done[role]);
      metrics[role + "/loss"] = t[kLoss] / updates;
      metrics[role + "/clip_fraction"] = t[kTokens] > 0 ? t[kClipTokens] / t[kTokens] : 0.0;
      if (role == "actor") metrics["actor/approx_kl"] = t[kTokens] > 0 ? t[kApproxKlTokens] / t[kTokens] : 0.0;
      metrics[role + "/grad_norm"] = t[kGradNorm];
      metrics[role + "/skipped_steps"] = t[kSkipped];
      metrics["memory/" + role + "_host_peak_mb"] = t[kPeakMb];
      seconds["train." + role] = t[kTrainSeconds] + t[kStepSeconds];
    }
    seconds["train"] = since(t0);
    trace_span("train", -1, w0, wall_us());
    if (train_actor) sync_weights();
  }

  void sync_weights() {
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    ++version;
    for (size_t i = 0; i < engines->size(); ++i) engines->client(i).begin_weight_update(version, false, plan_id);
    Message m;
    m.op = Op::kSync;
    m.scalars = {static_cast<double>(version)};
    for (int rank : actor_group->ranks) post(rank, m);
    for (size_t i = 0; i < engines->size(); ++i) {
      try {
        engines->client(i).end_weight_update(version, cfg.timeouts.weight_sync_s);
      } catch (const std::exception& e) {
        throw CommError(fmt::format("weight sync {} to engine {} ({}) failed: {}", version, i, engines->address(i),
                                    e.what()));
      }
    }
    double sync_s = 0, bytes = 0;
    for (int rank : actor_group->ranks) {
      const Message a = answer(rank, cfg.timeouts.weight_sync_s, "the weight sync");
      sync_s = std::max(sync_s, a.scalars.at(0));
      bytes = a.scalars.at(1);
    }
    settle_sends();
    seconds["sync"] = since(t0);
    metrics["sync/seconds_on_actor"] = sync_s;
    metrics["sync/wire_mb"] = bytes / 1e6;
    metrics["weight_version"] = static_cast<double>(version);
    trace_span("weight sync", -1, w0, wall_us());
  }

  // --- checkpoints ------------------------------------------------------------------------------

  std::string step_dir(int64_t s) const { return fmt::format("{}/step_{:06d}", ckpt_root, s); }

  // Complete checkpoints (controller.json written last), oldest first.
  std::vector<std::pair<int64_t, std::string>> checkpoints() const {
    std::vector<std::pair<int64_t, std::string>> out;
    std::error_code ec;
    if (ckpt_root.empty() || !fs::is_directory(ckpt_root, ec)) return out;
    for (const auto& e : fs::directory_iterator(ckpt_root, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step_", 0) != 0 || name.find('.') != std::string::npos) continue;
      if (!fs::exists(e.path() / "controller.json")) continue;
      out.emplace_back(std::stoll(name.substr(5)), e.path().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  void save() {
    if (ckpt_root.empty()) return;
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    const std::string dir = step_dir(step);
    std::error_code ec;
    fs::remove(fs::path(dir) / "controller.json", ec);  // incomplete until the end
    fs::create_directories(dir, ec);
    if (ec) throw IoError(fmt::format("{}: cannot create the checkpoint directory: {}", dir, ec.message()));
    Message m;
    m.op = Op::kSave;
    m.text = dir;
    call_trainers(m, cfg.timeouts.collective_s * 4, "the checkpoint save");
    json st;
    st["format"] = "tiller-controller-1";
    st["step"] = step;
    st["weight_version"] = version;
    st["actor_updates"] = actor_updates;
    st["critic_updates"] = critic_updates;
    st["dataset"] = {{"epoch", dataset->cursor().epoch}, {"position", dataset->cursor().position},
                     {"size", dataset->size()}};
    st["kl_coef"] = kl_ctl.value();
    st["reward_moments"] = {{"mean", reward_moments.mean()},
                            {"m2", reward_moments.m2()},
                            {"count", reward_moments.count()}};
    write_file_atomic(dir + "/controller.json", st.dump(2) + "\n");
    auto all = checkpoints();
    while (static_cast<int64_t>(all.size()) > cfg.checkpoint.keep_last) {
      remove_tree(all.front().second);
      all.erase(all.begin());
    }
    seconds["checkpoint"] = since(t0);
    trace_span("checkpoint", -1, w0, wall_us());
    log::info("checkpoint: step {} saved in {} ({:.1f} s)", step, dir, since(t0));
  }

  void resume() {
    const auto all = checkpoints();
    if (all.empty()) {
      if (opts.require_resume)
        throw ConfigError(fmt::format("--resume: no complete checkpoint under checkpoint.dir = {}",
                                      ckpt_root.empty() ? std::string("(empty)") : ckpt_root));
      return;
    }
    const std::string dir = all.back().second;
    const std::string path = dir + "/controller.json";
    json st;
    try {
      st = json::parse(read_file(path).value_or(""));
    } catch (const json::exception& e) {
      throw IoError(fmt::format("{}: not valid JSON ({}); remove this checkpoint to resume from the one before", path,
                                e.what()));
    }
    if (st.value("format", "") != "tiller-controller-1")
      throw IoError(fmt::format("{}: not a tiller controller state", path));
    if (st["dataset"].value("size", int64_t{-1}) != dataset->size())
      throw ConfigError(fmt::format("{}: saved with a dataset of {} prompts, data.prompts = {} now has {}; resume "
                                    "with the same data",
                                    path, st["dataset"].value("size", int64_t{-1}), cfg.data.prompts, dataset->size()));
    Message m;
    m.op = Op::kLoad;
    m.text = dir;
    call_trainers(m, cfg.timeouts.collective_s * 4, "loading the checkpoint");
    step = st.at("step").get<int64_t>();
    actor_updates = st.at("actor_updates").get<int64_t>();
    critic_updates = st.at("critic_updates").get<int64_t>();
    dataset->seek({st["dataset"].at("epoch").get<int64_t>(), st["dataset"].at("position").get<int64_t>()});
    kl_ctl = algo::KlController(st.at("kl_coef").get<double>(), cfg.algo.target_kl, cfg.algo.kl_horizon);
    reward_moments.restore(st["reward_moments"].at("mean").get<double>(), st["reward_moments"].at("m2").get<double>(),
                           st["reward_moments"].at("count").get<int64_t>());
    const uint64_t saved_version = st.at("weight_version").get<uint64_t>();
    log::info("resumed from {} (step {}, weight version {})", dir, step, saved_version);
    if (saved_version > 0) {
      // The engines started from the HF model: give them the actor's trained weights.
      version = saved_version - 1;
      sync_weights();
    }
  }

  // --- trace ------------------------------------------------------------------------------------

  void trace_span(const std::string& name, int rank, double begin_us, double end_us) {
    if (!profile_steps.count(step + 1)) return;
    const int pid = rank < 0 ? plan.controller : rank;
    trace_events.push_back({{"name", name}, {"ph", "X"}, {"ts", begin_us}, {"dur", end_us - begin_us},
                            {"pid", pid}, {"tid", 0}, {"args", {{"step", step + 1}}}});
  }

  void collect_traces() {
    Message m;
    m.op = Op::kTrace;
    const std::set<int> ranks = trainer_ranks();
    for (int r : ranks) post(r, m);
    for (int r : ranks) {
      const Message a = answer(r, cfg.timeouts.collective_s, "collecting the trace");
      if (!profile_steps.count(step + 1)) continue;
      const double* t = a.tensors.at(0).data_ptr<double>();
      size_t i = 0, pos = 0;
      while (pos < a.text.size()) {
        const size_t nl = a.text.find('\n', pos);
        trace_span(a.text.substr(pos, nl - pos), r, t[2 * i], t[2 * i + 1]);
        ++i;
        pos = nl + 1;
      }
    }
    settle_sends();
    if (!profile_steps.count(step + 1)) return;
    json doc;
    json events = json::array();
    for (const auto& a : plan.ranks)
      events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", a.rank},
                        {"args", {{"name", fmt::format("rank {} {}", a.rank, a.label())}}}});
    for (const auto& e : trace_events) events.push_back(e);
    doc["traceEvents"] = events;
    doc["displayTimeUnit"] = "ms";
    write_file_atomic(trace_path, doc.dump() + "\n");
    log::info("trace: step {} written to {}", step + 1, trace_path);
  }

  // --- the loop ---------------------------------------------------------------------------------

  void stop_ranks() {
    Message m;
    m.op = Op::kStop;
    std::set<int> ranks = trainer_ranks();
    for (const auto& e : plan.engines) ranks.insert(e.ranks.front());
    for (int r : ranks) post(r, m);
    double peak = peak_rss_mb();
    for (int r : ranks) {
      const Message a = answer(r, cfg.timeouts.collective_s, "stopping");
      if (!a.scalars.empty()) peak = std::max(peak, a.scalars[0]);
    }
    settle_sends();
    metrics["memory/host_peak_mb_all_ranks"] = peak;
  }

  int run() {
    if (cfg.checkpoint.resume || opts.require_resume) resume();
    const auto start = Clock::now();
    const int64_t first = step;
    bool stopped_by_signal = false;
    json last;
    while (step < cfg.train.num_steps) {
      const auto t0 = Clock::now();
      metrics = json::object();
      seconds.clear();
      generate_and_score();
      advantages();
      train();
      collect_traces();
      ++step;
      const bool last_step = step == cfg.train.num_steps;
      const bool signal = stop_requested();
      if ((cfg.checkpoint.every_steps > 0 && step % cfg.checkpoint.every_steps == 0) || last_step || signal) save();
      const double step_s = since(t0);
      double busy = 0;
      for (const char* k : {"generate", "score_tail", "advantage", "train", "sync", "checkpoint"})
        if (seconds.count(k)) busy += seconds[k];
      metrics["time/step"] = step_s;
      for (const auto& [k, v] : seconds) metrics["time/" + k] = v;
      metrics["time/controller_other"] = std::max(0.0, step_s - busy);
      metrics["samples"] = static_cast<double>(ro.size());
      metrics["memory/controller_rollout_mb"] = static_cast<double>(ro.bytes()) / 1e6;
      metrics["memory/controller_host_peak_mb"] = peak_rss_mb();
      Metrics flat;
      for (auto it = metrics.begin(); it != metrics.end(); ++it) flat.emplace_back(it.key(), it.value().get<double>());
      jsonl->write(step, flat);
      tensorboard->scalars(step, flat);
      const double per_step = since(start) / static_cast<double>(step - first);
      if (step % cfg.logging.every_steps == 0 || last_step)
        log::info("step {}/{} | reward {:.3f} ± {:.3f} | kl {:.4f} | entropy {:.3f} | len {:.1f} | gen {:.2f}s "
                  "train {:.2f}s sync {:.2f}s | {:.1f} s/step | ETA {}",
                  step, cfg.train.num_steps, metrics["reward/mean"].get<double>(), metrics["reward/std"].get<double>(),
                  metrics["kl/mean_per_sample"].get<double>(), metrics["entropy"].get<double>(),
                  metrics["response_length/mean"].get<double>(), seconds["generate"], seconds["train"],
                  seconds.count("sync") ? seconds["sync"] : 0.0, step_s,
                  hms(per_step * static_cast<double>(cfg.train.num_steps - step)));
      last = metrics;
      if (signal && !last_step) {
        stopped_by_signal = true;
        log::warn("stopping on a signal after step {}{}", step,
                  ckpt_root.empty() ? " (checkpoint.dir is empty: nothing saved)" : " (checkpoint saved)");
        break;
      }
    }
    stop_ranks();
    json summary;
    summary["event"] = stopped_by_signal ? "stopped" : "done";
    summary["steps"] = step;
    summary["seconds"] = since(start);
    summary["weight_version"] = version;
    if (!last.empty()) {
      summary["reward_mean"] = last["reward/mean"];
      summary["kl_mean_per_sample"] = last["kl/mean_per_sample"];
    }
    summary["host_peak_mb"] = metrics["memory/host_peak_mb_all_ranks"];
    summary["checkpoint"] = ckpt_root.empty() || checkpoints().empty() ? "" : checkpoints().back().second;
    std::printf("%s\n", summary.dump().c_str());
    std::fflush(stdout);
    return 0;
  }
};

Controller::Controller(const JobConfig& cfg, const dist::RankPlan& plan, dist::Communicator& world,
                       ControllerOptions opts)
    : impl_(std::make_unique<Impl>(cfg, plan, world, std::move(opts))) {}
Controller::~Controller() = default;
int Controller::run() { return impl_->run(); }

}  // namespace tiller::rollout
