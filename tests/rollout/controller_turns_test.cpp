// The controller's samples beyond single turns, over an in-process channel: multi-turn episodes
// with an in-process environment, and a registered sample loop.
#include "controller_job.h"

#include <condition_variable>
#include <thread>

#include "controller/env_runner.h"

namespace tiller::controller {
namespace {

// --- multi-turn samples ------------------------------------------------------------------------

// An in-process environment: each turn's reward is its share of even ids; the episode is done
// when a turn starts with an even id (or at its turn limit). Its observation is "ok" and then one
// more "!" per turn, so observation lengths differ; every session must be closed exactly once.
class EvenGame final : public env::Environment {
 public:
  env::Observation start(const env::EpisodeStart& e, Deadline) override {
    std::lock_guard<std::mutex> lock(mu);
    ++starts;
    open.insert(e.session_id);
    return {};
  }
  env::StepResult step(const std::string& session, const env::Action& a, Deadline) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!open.count(session)) throw Error("step of a session that is not open: " + session);
      ++steps;
      if (fail_at_step > 0 && steps == fail_at_step) throw CommError("env even at test: Step of session " + session +
                                                                       " turn " + std::to_string(a.turn) + " failed: boom");
    }
    double even = 0;
    for (int64_t t : a.tokens) even += t % 2 == 0;
    env::StepResult r;
    r.reward = even / static_cast<double>(a.tokens.size());
    r.done = a.tokens.front() % 2 == 0;
    r.observation.text = "ok" + std::string(static_cast<size_t>(a.turn), '!');
    return r;
  }
  void close(const std::string& session, Deadline) override {
    std::lock_guard<std::mutex> lock(mu);
    ++closes;
    open.erase(session);
  }
  std::string name() const override { return "env even (in-process)"; }
  std::mutex mu;
  std::set<std::string> open;
  int starts = 0, steps = 0, closes = 0, fail_at_step = 0;
};

struct MultiTurnJob : Job {
  std::shared_ptr<EvenGame> game = std::make_shared<EvenGame>();
  explicit MultiTurnJob(const std::string& name) : Job(name) {
    cfg.env.type = EnvType::kInprocess;
    cfg.env.name = "even";
    cfg.rollout.max_turns = 3;
    cfg.rollout.max_new_tokens = 12;
    cfg.rollout.max_response_tokens = 30;
    cfg.logging.rollout_records_tokens = true;
    cfg.env.concurrency = 4;
    cfg.env.timeout_s = 10;
    loop.environment = game;
    // Observation text -> ids 900 + char % 50 (the synthetic vocabulary has 1000).
    loop.observation_tokens = [](const std::string& text, bool, bool) {
      std::vector<int64_t> ids;
      for (char c : text) ids.push_back(900 + static_cast<unsigned char>(c) % 50);
      return ids;
    };
    loop.decode = [](const std::vector<int64_t>& ids) { return std::to_string(ids.size()) + " ids"; };
  }
};

// Each sample is an episode of up to 3 model turns with the environment's observations between
// them: the record's loss mask covers exactly the observation tokens, each turn ends on a model
// token, the turn rewards are the environment's, the response stays within max_response_tokens,
// every session is started and closed once, and the metrics count turns and tokens by origin.
TEST(ControllerInProcess, MultiTurnSamplesAreEpisodesWithTheirObservationsMasked) {
  MultiTurnJob job("multi_turn");
  job.cfg.train.num_steps = 3;
  const json summary = json::parse(job.run());
  EXPECT_EQ(summary["steps"], 3);
  const auto recs = job.records();
  ASSERT_EQ(recs.size(), 3u * 4 * 2);
  int64_t multi = 0, cut = 0, model_total = 0;
  for (const auto& r : recs) {
    const auto mask = r["loss_mask"].get<std::vector<int>>();
    const auto ids = r["response_ids"].get<std::vector<int64_t>>();
    const auto turns = r["turns"];
    ASSERT_EQ(mask.size(), ids.size()) << r.dump();
    EXPECT_LE(static_cast<int64_t>(ids.size()), 30) << r.dump();
    ASSERT_GE(turns.size(), 1u);
    EXPECT_LE(turns.size(), 3u);
    // The observations ("ok", then one "!" per turn: ids 911 907 933...) sit between the turns, and
    // the mask is 0 there and only there.
    std::vector<int> want(ids.size(), 1);
    for (size_t t = 0; t + 1 < turns.size(); ++t)
      for (size_t k = 0; k < 3 + t; ++k) {
        const size_t at = turns[t][0].get<size_t>() + 1 + k;
        ASSERT_LT(at, ids.size());
        want[at] = 0;
        EXPECT_EQ(ids[at], k == 0 ? 911 : k == 1 ? 907 : 933) << "token " << at << " of " << r.dump();
      }
    EXPECT_EQ(mask, want) << r.dump();
    int64_t model = 0;
    for (int v : mask) model += v;
    EXPECT_EQ(r["model_tokens"].get<int64_t>(), model);
    model_total += model;
    size_t start = 0, last_start = 0;
    for (size_t t = 0; t < turns.size(); ++t) {
      const auto end = turns[t][0].get<size_t>();
      ASSERT_LT(end, ids.size());
      EXPECT_EQ(mask[end], 1);
      EXPECT_TRUE(end + 1 == ids.size() || mask[end + 1] == 0) << "turn " << t << " of " << r.dump();
      double even = 0;
      for (size_t k = start; k <= end; ++k) even += ids[k] % 2 == 0;
      EXPECT_NEAR(turns[t][1].get<double>(), even / static_cast<double>(end + 1 - start), 1e-6);
      last_start = start;
      start = end + 1 + 3 + t;  // after "ok" and one "!" per turn so far
      if (t + 1 < turns.size()) EXPECT_NE(ids[last_start] % 2, 0) << "the game was done after turn " << t + 1;
    }
    const bool done = ids[last_start] % 2 == 0;
    multi += turns.size() > 1;
    cut += !done;
  }
  EXPECT_GT(multi, 0) << "no sample took more than one turn";
  EXPECT_GT(cut, 0) << "no episode ran into its limits";
  // The controller (its sample loop) has waited for the environment's last calls (the Closes).
  {
    std::lock_guard<std::mutex> lock(job.game->mu);
    EXPECT_EQ(job.game->starts, 3 * 4 * 2);
    EXPECT_EQ(job.game->closes, job.game->starts);
    EXPECT_TRUE(job.game->open.empty());
  }
  // Only the model's tokens trained: the synthetic actor was sent every response token, and the
  // normalizer the controller sent counts the model's.
  const auto metrics = job.lines("metrics.jsonl");
  double model_metric = 0;
  for (const auto& m : metrics) {
    for (const char* k : {"turns/mean", "turns/max", "tokens/model", "tokens/observation", "reward/env_mean",
                          "env/seconds_per_sample", "env/calls", "env/session_prefix_tokens"})
      EXPECT_TRUE(m.contains(k)) << k;
    model_metric += m["tokens/model"].get<double>();
  }
  EXPECT_EQ(model_metric, model_total);
  EXPECT_GT(metrics.back()["turns/mean"].get<double>(), 1.0);
}

// The asynchronous pipeline with multi-turn samples: episodes span weight syncs (partial
// rollouts) within the lag bound, and with the drop policy groups dropped mid-episode have their
// turns aborted and their sessions closed; every session the environment started is closed.
TEST(ControllerInProcess, MultiTurnSamplesInTheAsynchronousPipeline) {
  int64_t spanning = 0;
  for (bool drop : {false, true}) {
    MultiTurnJob job(drop ? "multi_turn_drop" : "multi_turn_async");
    job.cfg.rollout.mode = RolloutMode::kAsync;
    job.cfg.rollout.max_staleness = 1;
    job.cfg.rollout.partial = true;
    if (drop) job.cfg.rollout.stale_policy = StalePolicy::kDrop;
    job.cfg.train.num_steps = 8;
    job.cfg.rollout.max_new_tokens = 40;
    job.cfg.rollout.max_response_tokens = 100;
    testing::SyntheticEngineOptions eo;
    eo.min_len = 1;
    eo.max_len = 40;
    job.run(eo);
    const auto recs = job.records();
    EXPECT_EQ(recs.size(), 8u * 4 * 2) << "drop " << drop;
    for (const auto& r : recs) {
      EXPECT_LE(r["lag"].get<int64_t>(), 1) << r.dump();
      EXPECT_LE(r["response_len"].get<int64_t>(), 100);
      const auto& runs = r["version_runs"];
      for (size_t i = 1; i < runs.size(); ++i) {  // turns drawn by later weights continue the runs
        EXPECT_GT(runs[i][0].get<int64_t>(), runs[i - 1][0].get<int64_t>()) << r.dump();
        EXPECT_GT(runs[i][1].get<int64_t>(), runs[i - 1][1].get<int64_t>()) << r.dump();
      }
      spanning += runs.size() > 1;
    }
    if (drop) EXPECT_GT(job.records("dropped_stale").size(), 0u) << "no group was dropped";
    // The controller (its sample loop) has waited for the last Closes.
    std::lock_guard<std::mutex> lock(job.game->mu);
    EXPECT_EQ(job.game->closes, job.game->starts) << "drop " << drop;
    EXPECT_TRUE(job.game->open.empty()) << job.game->open.size() << " sessions left open (drop " << drop << ")";
  }
  EXPECT_GT(spanning, 0) << "no episode spanned a weight sync";
}

// A group dropped while its episode's Start (or Step) is on the environment: the Close waits for
// that call to end and then runs, never before or beside it (else the session would open after
// its Close and stay open); a Close with nothing in flight runs at once; a Start still queued
// behind another is skipped, and nothing closes the session it never opened.
TEST(EnvRunner, ACloseWaitsForItsSessionsCallInFlight) {
  struct Gated final : env::Environment {
    env::Observation start(const env::EpisodeStart& e, Deadline) override {
      std::unique_lock<std::mutex> lock(mu);
      log.push_back("start " + e.session_id + " begins");
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return open_gate; });
      log.push_back("start " + e.session_id + " ends");
      return {};
    }
    env::StepResult step(const std::string&, const env::Action&, Deadline) override { return {}; }
    void close(const std::string& session, Deadline) override {
      std::lock_guard<std::mutex> lock(mu);
      log.push_back("close " + session);
      cv.notify_all();
    }
    std::string name() const override { return "env gated (in-process)"; }
    std::mutex mu;
    std::condition_variable cv;
    bool open_gate = false;
    std::vector<std::string> log;
  };
  auto env = std::make_shared<Gated>();
  EnvRunner runner(env, 1, 30);  // one worker: c's Start waits behind a's
  env::EpisodeStart e;
  e.session_id = "a";
  runner.start(1, e);
  {
    std::unique_lock<std::mutex> lock(env->mu);
    ASSERT_TRUE(env->cv.wait_for(lock, std::chrono::seconds(20), [&] { return !env->log.empty(); }));
  }
  e.session_id = "c";
  runner.start(3, e);
  runner.close("a");  // while its Start runs
  runner.close("c");  // while its Start is queued
  runner.close("b");  // nothing in flight: queued at once, behind c's Start
  {
    std::unique_lock<std::mutex> lock(env->mu);
    env->cv.wait_for(lock, std::chrono::milliseconds(100));  // time for a Close that would overtake
    EXPECT_EQ(env->log, std::vector<std::string>{"start a begins"});
    env->open_gate = true;
    env->cv.notify_all();
  }
  for (int i = 0; i < 2000 && runner.busy() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(runner.busy(), 0u);
  std::lock_guard<std::mutex> lock(env->mu);
  EXPECT_EQ(env->log, (std::vector<std::string>{"start a begins", "start a ends", "close b", "close a"}));
  EXPECT_EQ(runner.poll().size(), 1u);  // a's Start's answer (its group is gone: the loop ignores it)
}

// A failing environment call ends the job with its message and the sample it was for.
TEST(ControllerInProcess, AFailingEnvironmentEndsTheJobNamingTheSample) {
  MultiTurnJob job("multi_turn_fails");
  job.game->fail_at_step = 5;
  std::string error;
  job.run({}, &error);
  EXPECT_NE(error.find("env even at test: Step of session tiller-"), std::string::npos) << error;
  EXPECT_NE(error.find("failed: boom (prompt line"), std::string::npos) << error;
  EXPECT_NE(error.find(", step 1)"), std::string::npos) << error;
}

// --- sample loops (tiller/controller/sample_loop.h) ----------------------------------------------------

// A loop of the kind an agent writes: each sample drafts (the group's one request of n), then
// revises once (a request of one sample whose prompt is the prompt, the draft and two marker ids of
// the loop's own), and hands back draft + markers + revision with the markers masked. loop_args
// "marker=<id>" picks the first marker; "twice" finishes sample 0 twice, "resend" sends the group's
// own request twice, "nan" gives a turn a NaN reward (broken loops).
class ReviseLoop final : public SampleLoop {
 public:
  explicit ReviseLoop(const SampleLoopContext& c) : host_(*c.host), ctx_(c) {
    const std::string& a = c.job->rollout.loop_args;
    if (a == "twice" || a == "resend" || a == "nan") {
      broken_ = a;
    } else if (a.rfind("marker=", 0) == 0) {
      marker_ = std::stoll(a.substr(7));
    } else {
      throw ConfigError("rollout.loop_args = '" + a + "': marker=<id>, twice, resend or nan");
    }
  }
  void start(int64_t group) override {
    engine::Request r;
    r.prompt = host_.prompt(group).tokens;
    r.n = ctx_.n;
    r.params = ctx_.sampling;
    r.params.seed = host_.seed(group);
    if (broken_ == "resend") host_.generate(group, r, true);
    host_.generate(group, std::move(r), true);
  }
  void generated(int64_t group, uint64_t request, engine::SampleOutput out) override {
    if (request == static_cast<uint64_t>(group)) {  // a draft: revise it
      Sample& s = samples_[{group, out.sample}];
      s.draft = std::move(out);
      const int64_t room = ctx_.max_response_tokens - static_cast<int64_t>(s.draft.tokens.size()) - 2;
      if (room < 1) return finish(group, s.draft.sample, s, {});
      engine::Request r;
      r.prompt = host_.prompt(group).tokens;
      r.prompt.insert(r.prompt.end(), s.draft.tokens.begin(), s.draft.tokens.end());
      r.prompt.push_back(marker_);
      r.prompt.push_back(marker_ + 1);
      r.params = ctx_.sampling;
      r.params.seed = host_.seed(group) + 1000 + static_cast<uint64_t>(s.draft.sample);
      r.params.max_new_tokens = std::min(room, ctx_.sampling.max_new_tokens);
      revisions_[host_.generate(group, std::move(r), false)] = {group, s.draft.sample};
      return;
    }
    const auto key = revisions_.at(request);
    revisions_.erase(request);
    finish(key.first, key.second, samples_.at(key), std::move(out));
  }
  void drop(int64_t group) override {
    host_.abort(group, static_cast<uint64_t>(group));
    for (auto it = revisions_.begin(); it != revisions_.end();) {
      if (it->second.first != group) {
        ++it;
        continue;
      }
      host_.abort(group, it->first);
      it = revisions_.erase(it);
    }
    for (auto it = samples_.begin(); it != samples_.end();) it = it->first.first == group ? samples_.erase(it) : ++it;
  }

 private:
  struct Sample {
    engine::SampleOutput draft;
  };
  void finish(int64_t group, int64_t sample, Sample& s, engine::SampleOutput revision) {
    FinishedSample f;
    f.sample = sample;
    f.out = std::move(s.draft);
    const int64_t draft_len = static_cast<int64_t>(f.out.tokens.size());
    f.turns.loss_mask.assign(f.out.tokens.size(), 1);
    f.turns.ends.push_back(draft_len - 1);
    f.turns.rewards.push_back(0.f);
    if (!revision.tokens.empty()) {
      for (int64_t m : {marker_, marker_ + 1}) {
        f.out.tokens.push_back(m);
        f.out.logprobs.push_back(0.f);
        f.turns.loss_mask.push_back(0);
      }
      f.out.tokens.insert(f.out.tokens.end(), revision.tokens.begin(), revision.tokens.end());
      f.out.logprobs.insert(f.out.logprobs.end(), revision.logprobs.begin(), revision.logprobs.end());
      f.turns.loss_mask.insert(f.turns.loss_mask.end(), revision.tokens.size(), 1);
      f.turns.ends.push_back(static_cast<int64_t>(f.out.tokens.size()) - 1);
      f.turns.rewards.push_back(0.25f);
      f.out.finish_reason = revision.finish_reason;
    }
    samples_.erase({group, sample});
    if (broken_ == "nan") f.turns.rewards.back() = std::nanf("");
    if (broken_ == "twice" && sample == 0) host_.finish(group, f);
    host_.finish(group, std::move(f));
  }

  LoopHost& host_;
  SampleLoopContext ctx_;
  int64_t marker_ = 0;
  std::string broken_;
  std::map<std::pair<int64_t, int64_t>, Sample> samples_;
  std::map<uint64_t, std::pair<int64_t, int64_t>> revisions_;  // request -> (group, sample)
};

void register_revise_loop() {
  static const bool once = [] {
    SampleLoopDef d;
    d.make = [](const SampleLoopContext& c) -> std::unique_ptr<SampleLoop> { return std::make_unique<ReviseLoop>(c); };
    d.turns = true;
    d.summary = "draft, then revise once";
    register_sample_loop("test_revise", d);
    return true;
  }();
  ASSERT_TRUE(once);
}

// The registered loop makes the samples: every record is a draft, the loop's two marker ids
// (masked) and a revision, with the loop's turn rewards; the built-in single_turn path would give
// one unmasked turn. Unknown names, a loop that needs an environment without one, single_turn with
// one, and loops that finish a sample twice, send the group's request twice or give a NaN turn
// reward are refused by name.
TEST(SampleLoops, ARegisteredLoopIsTheOneThatMakesTheSamples) {
  register_revise_loop();
  Job job("sample_loop");
  job.cfg.train.num_steps = 2;
  job.cfg.rollout.loop = "test_revise";
  job.cfg.rollout.loop_args = "marker=950";
  job.cfg.logging.rollout_records_tokens = true;
  const json summary = json::parse(job.run());
  EXPECT_EQ(summary["steps"], 2);
  const auto recs = job.records();
  ASSERT_EQ(recs.size(), 2u * 4 * 2);
  int64_t revised = 0;
  for (const auto& r : recs) {
    const auto ids = r["response_ids"].get<std::vector<int64_t>>();
    const auto mask = r["loss_mask"].get<std::vector<int>>();
    const auto turns = r["turns"];
    ASSERT_EQ(mask.size(), ids.size()) << r.dump();
    EXPECT_LE(static_cast<int64_t>(ids.size()), job.cfg.rollout.max_new_tokens) << r.dump();
    ASSERT_GE(turns.size(), 1u) << r.dump();
    if (turns.size() == 1) continue;  // no room to revise
    ASSERT_EQ(turns.size(), 2u) << r.dump();
    ++revised;
    const auto draft_end = turns[0][0].get<size_t>();
    std::vector<int> want(ids.size(), 1);
    want[draft_end + 1] = want[draft_end + 2] = 0;
    EXPECT_EQ(mask, want) << r.dump();
    EXPECT_EQ(ids[draft_end + 1], 950);
    EXPECT_EQ(ids[draft_end + 2], 951);
    EXPECT_EQ(turns[1][0].get<size_t>(), ids.size() - 1);
    EXPECT_FLOAT_EQ(turns[1][1].get<float>(), 0.25f);
  }
  EXPECT_GT(revised, 0) << "no sample was revised";

  JobConfig cfg;
  cfg.rollout.loop = "test_revis";
  EXPECT_NE(error_of([&] { job_sample_loop(cfg); })
                .find("rollout.loop = 'test_revis': not a registered sample loop (registered: multi_turn, openai_agent, "
                      "single_turn, test_revise"),
            std::string::npos);
  EXPECT_NE(error_of([&] { job_sample_loop(cfg); }).find("did you mean 'test_revise'?"), std::string::npos);
  cfg.rollout.loop = "multi_turn";
  EXPECT_NE(error_of([&] { job_sample_loop(cfg); }).find("rollout.loop = multi_turn: this loop needs an environment"),
            std::string::npos);
  cfg.rollout.loop = "single_turn";
  cfg.env.type = EnvType::kInprocess;
  cfg.env.name = "even";
  EXPECT_NE(error_of([&] { job_sample_loop(cfg); }).find("the environment would never be called"), std::string::npos);
  cfg.rollout.loop = "";
  EXPECT_EQ(job_sample_loop(cfg), "multi_turn");
  EXPECT_EQ(job_sample_loop(JobConfig{}), "single_turn");

  Job broken("sample_loop_twice");
  broken.cfg.rollout.loop = "test_revise";
  broken.cfg.rollout.loop_args = "twice";
  std::string error;
  broken.run({}, &error);
  EXPECT_NE(error.find("sample loop 'test_revise', prompt line"), std::string::npos) << error;
  EXPECT_NE(error.find("sample 0: finished twice"), std::string::npos) << error;
  for (const auto& [args, want] : {std::pair<std::string, std::string>{"resend", "is sent once, with n = 2 samples (it had n = 2, and was sent already)"},
                                   {"nan", "reward is nan, not a finite number"}}) {
    Job bad("sample_loop_" + args);
    bad.cfg.rollout.loop = "test_revise";
    bad.cfg.rollout.loop_args = args;
    std::string why;
    bad.run({}, &why);
    EXPECT_NE(why.find("sample loop 'test_revise'"), std::string::npos) << why;
    EXPECT_NE(why.find(want), std::string::npos) << why;
  }
}

}  // namespace
}  // namespace tiller::controller
