// The whole controller without mpirun: the collector, training dispatch and the controller over
// an in-process channel to synthetic trainer ranks and synthetic engines (src/testing/synthetic.h),
// with the real packer, host arrays, protocol and algorithms: sync, async and hybrid pipelines,
// partial rollouts, dynamic sampling, step hooks, batch scorers, PPO, and the failures named.
#include "controller_job.h"
#include "tiller/reward/rule_reward.h"

namespace tiller::controller {
namespace {

// cluster.hybrid: each step the trainers offload, the engines wake and generate, then sleep while
// the trainers reload and train, and wake their weights for the sync; the engines never get a
// request while asleep (SyntheticEngines refuses it). What is trained is what the separate pools
// train, sample for sample.
TEST(ControllerInProcess, HybridAlternatesThePhasesAndTrainsWhatSeparatePoolsTrain) {
  Job pools("hybrid_pools");
  pools.cfg.roles.actor.gpus = 2;
  pools.run();
  Job hybrid("hybrid");
  hybrid.cfg.roles.actor.gpus = 2;
  hybrid.cfg.cluster.hybrid = true;
  hybrid.cfg.engines.count = 1;  // derived: one per actor rank
  hybrid.cfg.roles.actor.offload = true;
  hybrid.cfg.engines.sleep_level = 2;
  const json summary = json::parse(hybrid.run());
  EXPECT_EQ(summary["event"], "done");
  EXPECT_EQ(summary["weight_version"], 6);
  EXPECT_TRUE(hybrid.plan.hybrid);
  ASSERT_EQ(hybrid.engines->size(), 2u);
  std::vector<std::string> want;
  for (int j = 1; j <= 6; ++j)
    for (const std::string& p : {std::string("wake cache"), std::string("sleep 2"), std::string("wake weights"),
                                 "sync " + std::to_string(j)})
      want.push_back(p);
  EXPECT_EQ(hybrid.engines->phases(), want);
  ASSERT_EQ(hybrid.trainers.size(), 2u);
  for (auto* t : hybrid.trainers) {
    ASSERT_EQ(t->phases().size(), 12u);
    for (size_t i = 0; i < 12; ++i) EXPECT_EQ(t->phases()[i], i % 2 == 0 ? "offload" : "reload");
  }
  const auto a = pools.records(), b = hybrid.records();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].dump(), b[i].dump()) << "record " << i;
  const auto ma = pools.lines("metrics.jsonl"), mb = hybrid.lines("metrics.jsonl");
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["reward/mean"], mb[i]["reward/mean"]);
    EXPECT_TRUE(mb[i].contains("memory/generate/engine_kv_cache_gb")) << mb[i].dump();
    EXPECT_TRUE(mb[i].contains("memory/train/allocated_gb"));
  }
}

// cluster.hybrid_scoring = after_generate (what auto picks for TP > 1 engines over NCCL): no score
// request reaches a trainer while an engine still generates; the engines sleep at level 1 for the
// scoring, then at the configured level for the training. The same samples train as when the
// trainers score beside the generation (overlap), which does score while the engines generate.
TEST(ControllerInProcess, HybridScoringAfterGenerateNeverScoresWhileTheEnginesGenerate) {
  auto hybrid_job = [](const std::string& name, HybridScoring scoring) {
    Job job(name);
    job.cfg.roles.actor.gpus = 2;
    job.cfg.cluster.hybrid = true;
    job.cfg.cluster.hybrid_scoring = scoring;
    job.cfg.engines.tp = 2;
    job.cfg.engines.count = 1;
    job.cfg.engines.sleep_level = 2;
    // Enough samples that a round for both actor ranks fills while the engine still generates.
    job.cfg.rollout.batch_size = 8;
    job.cfg.train.train_batch_size = 8;
    return job;
  };
  Job overlap = hybrid_job("hybrid_overlap", HybridScoring::kOverlap);
  EXPECT_EQ(json::parse(overlap.run())["event"], "done");
  Job after = hybrid_job("hybrid_after_generate", HybridScoring::kAfterGenerate);
  const json summary = json::parse(after.run());
  EXPECT_EQ(summary["event"], "done");
  EXPECT_EQ(summary["weight_version"], 6);
  int64_t beside = 0;
  for (auto* t : overlap.trainers) beside += t->scored_while_generating();
  EXPECT_GT(beside, 0) << "the overlapping run should score while its engines generate";
  for (auto* t : after.trainers) {
    EXPECT_GT(t->scored_tokens(), 0);
    EXPECT_EQ(t->scored_while_generating(), 0);
  }
  std::vector<std::string> want;
  for (int j = 1; j <= 6; ++j)
    for (const std::string& p : {std::string("wake cache"), std::string("sleep 1"), std::string("sleep 2"),
                                 std::string("wake weights"), "sync " + std::to_string(j)})
      want.push_back(p);
  EXPECT_EQ(after.engines->phases(), want);
  const auto a = overlap.records(), b = after.records();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].dump(), b[i].dump()) << "record " << i;
  for (const json& m : after.lines("metrics.jsonl")) {
    EXPECT_TRUE(m.contains("memory/score/engine_kv_cache_gb")) << m.dump();
    EXPECT_TRUE(m.contains("memory/score/peak_allocated_gb")) << m.dump();
  }
}

// A step without an actor update (the critic's warm-up) has no sync to refill weights freed by a
// level-2 sleep: the engines sleep at level 1 then, and the next generation finds its weights.
TEST(ControllerInProcess, HybridStepsWithoutASyncKeepTheEnginesWeights) {
  Job job("hybrid_warmup", /*critic=*/true);
  job.cfg.cluster.hybrid = true;
  job.cfg.roles.critic.colocate_with = "actor";
  job.cfg.engines.count = 1;
  job.cfg.engines.sleep_level = 2;
  job.cfg.train.critic_warmup_steps = 2;
  const json summary = json::parse(job.run());
  EXPECT_EQ(summary["event"], "done");
  EXPECT_EQ(summary["weight_version"], 4);
  std::vector<std::string> want = {"wake cache", "sleep 1", "wake cache", "sleep 1"};
  for (int v = 1; v <= 4; ++v)
    for (const std::string& p : {std::string("wake cache"), std::string("sleep 2"), std::string("wake weights"),
                                 "sync " + std::to_string(v)})
      want.push_back(p);
  EXPECT_EQ(job.engines->phases(), want);
}

// eval.prompts: held-out prompts evaluated on the engines at the start and after every 4th step
// and the last, greedy and k = 3 samples each, scored by eval.reward_rule, while the same samples
// train as without it (evaluation requests share the engines, never the batches); the metrics are
// what the samples files say, per data source and over all; in a hybrid job the evaluation wakes
// the engines (SyntheticEngines refuses a request to a sleeping cache).
TEST(ControllerInProcess, EvaluationScoresHeldOutPromptsAndNeverChangesWhatTrains) {
  reward::register_rule_reward("test_even_length", [](const reward::Sample& s) { return s.response_text.size() % 2 == 0 ? 1.0 : 0.0; });
  const std::string prompts = scratch("eval_prompts") + "/eval.jsonl";
  {
    std::ofstream f(prompts);
    for (int i = 0; i < 10; ++i)
      f << json{{"input", "question " + std::to_string(i)}, {"data_source", i < 4 ? "alpha" : "beta"}}.dump() << "\n";
  }
  const auto with_eval = [&](Job& job) {
    job.cfg.eval.prompts = prompts;
    job.cfg.eval.every_steps = 4;
    job.cfg.eval.before_train = true;
    job.cfg.eval.n_samples = 3;
    job.cfg.eval.reward_rule = "test_even_length";
    job.cfg.eval.samples_per_source = -1;
  };
  for (const bool hybrid : {false, true}) {
    const std::string tag = hybrid ? "_hybrid" : "";
    Job plain("eval_off" + tag), evaluated("eval_on" + tag);
    for (Job* job : {&plain, &evaluated}) {
      job->cfg.cluster.hybrid = hybrid;
      if (hybrid) job->cfg.engines.count = 1;
    }
    with_eval(evaluated);
    plain.run();
    EXPECT_EQ(json::parse(evaluated.run())["event"], "done");
    // The same samples of every step (in the order they came back, which the evaluation shifts).
    auto a = plain.records(), b = evaluated.records();
    const auto order = [](const json& x, const json& y) {
      return std::tuple(x["step"].get<int64_t>(), x["ordinal"].get<int64_t>(), x["sample"].get<int64_t>()) <
             std::tuple(y["step"].get<int64_t>(), y["ordinal"].get<int64_t>(), y["sample"].get<int64_t>());
    };
    std::sort(a.begin(), a.end(), order);
    std::sort(b.begin(), b.end(), order);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].dump(), b[i].dump()) << "record " << i << tag;
    std::vector<int64_t> steps;
    for (const json& row : evaluated.lines("metrics.jsonl")) {
      if (!row.contains("time/eval")) continue;
      const int64_t step = row["step"];
      steps.push_back(step);
      const auto samples = evaluated.lines("eval/step_" + std::to_string(step) + ".jsonl");
      ASSERT_EQ(samples.size(), 10u * 4) << step;
      std::map<std::string, std::map<int64_t, std::vector<double>>> by;  // source -> line -> rewards (greedy first)
      for (const json& s : samples) {
        EXPECT_EQ(s["reward"].get<double>(), s["response"].get<std::string>().size() % 2 == 0 ? 1.0 : 0.0);
        for (const std::string src : {s["data_source"].get<std::string>(), std::string("all")})
          by[src][s["line"].get<int64_t>()].push_back(s["reward"].get<double>());
      }
      for (const auto& [src, lines] : by) {
        double greedy = 0, passed = 0, correct = 0;
        for (const auto& [line, r] : lines) {
          ASSERT_EQ(r.size(), 4u);
          greedy += r[0];
          passed += std::max({r[1], r[2], r[3]});
          correct += r[1] + r[2] + r[3];
        }
        const double n = static_cast<double>(lines.size());
        const std::string p = "eval/" + src + "/";
        EXPECT_EQ(row[p + "prompts"].get<double>(), n);
        EXPECT_DOUBLE_EQ(row[p + "greedy_accuracy"].get<double>(), greedy / n) << p << step;
        EXPECT_DOUBLE_EQ(row[p + "pass@3"].get<double>(), passed / n) << p << step;
        EXPECT_DOUBLE_EQ(row[p + "mean@3"].get<double>(), correct / (3 * n)) << p << step;
      }
      EXPECT_EQ(by.size(), 3u);  // alpha, beta, all
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{0, 4, 6})) << tag;
    EXPECT_EQ(evaluated.lines("metrics.jsonl").front()["step"], 0);
  }
  // Prompts x samples has a bound: 4,100 prompts of 1,025 samples each are refused at load.
  const std::string many = scratch("eval_many") + "/eval.jsonl";
  {
    std::ofstream f(many);
    for (int i = 0; i < 4100; ++i) f << json{{"input", "q " + std::to_string(i)}}.dump() << "\n";
  }
  Job big("eval_big");
  with_eval(big);
  big.cfg.eval.prompts = many;
  big.cfg.eval.n_samples = 1024;
  const auto tok = text::load_tokenizer(std::string(TILLER_HF_FIXTURES) + "/tokenizers/qwen2");
  testing::SyntheticEngines engines(testing::SyntheticEngineOptions{});
  EXPECT_NE(error_of([&] { Evaluator(big.cfg, *tok, engines, {}); }).find("lower eval.max_prompts or eval.n_samples"),
            std::string::npos);
  big.cfg.eval.max_prompts = 100;
  EXPECT_EQ(Evaluator(big.cfg, *tok, engines, {}).prompts(), 100);
}

// A standalone engine that dies mid-evaluation or mid-step, or stalls (retired after
// timeouts.generate_s without a sample): its requests go, whole, to the engine left, the samples
// that came back before it left stay and their repeats are dropped, so the job ends with exactly
// the samples and evaluation of a job whose engines all lived (the synthetic engines draw by seed,
// wherever a request runs).
TEST(ControllerInProcess, AnEngineThatDiesMidEvaluationOrMidStepLosesNoSample) {
  const std::string prompts = scratch("eval_dies_prompts") + "/eval.jsonl";
  {
    std::ofstream f(prompts);
    for (int i = 0; i < 10; ++i) f << json{{"input", "question " + std::to_string(i)}}.dump() << "\n";
  }
  const auto by_key = [](std::vector<json> rows, std::vector<std::string> keys) {
    std::map<std::string, std::string> out;
    for (json& r : rows) {
      std::string k;
      for (const auto& key : keys) k += r[key].dump() + "/";
      EXPECT_TRUE(out.emplace(k, r.dump()).second) << "twice: " << k;
    }
    return out;
  };
  for (const std::string how : {"dies_eval", "dies_step", "stalls_eval"}) {
    const bool eval = how != "dies_step";
    const std::string tag = "_" + how;
    Job lived("lives" + tag), died("leaves" + tag);
    for (Job* job : {&lived, &died}) {
      job->cfg.train.num_steps = 3;
      job->cfg.engines.max_num_seqs = 8;
      if (!eval) continue;
      job->cfg.eval.prompts = prompts;
      job->cfg.eval.every_steps = 2;
      job->cfg.eval.before_train = true;
      job->cfg.eval.n_samples = 3;
      job->cfg.eval.samples_per_source = -1;
    }
    lived.run();
    ManualClock clock;  // a bookkeeping slip would end the run at timeouts.generate_s, not hang it
    testing::SyntheticEngineOptions eo;
    eo.clock = &clock;
    eo.seconds_per_step = 0.25;
    eo.dying_engine = 1;
    eo.die_after_steps = 8;  // within the first evaluation, or the first step's generation, with samples of
                             // its requests back already (found by trying)
    if (how == "stalls_eval") {
      eo.stalled_engine = 1;  // from the start: it never decodes, so never dies
      died.cfg.timeouts.generate_s = 30;
    }
    EXPECT_EQ(json::parse(died.run(eo))["event"], "done") << tag;
    EXPECT_EQ(by_key(died.records(), {"ordinal", "sample"}), by_key(lived.records(), {"ordinal", "sample"})) << tag;
    const auto rows = died.lines("metrics.jsonl");
    ASSERT_FALSE(rows.empty());
    EXPECT_EQ(rows.back()["engines/count"], 1) << tag;
    for (const json& row : rows)  // every phase time on the job's (virtual) clock
      for (const auto& [key, value] : row.items())
        if (key.rfind("time/", 0) == 0) EXPECT_GE(value.get<double>(), 0.0) << key << " at step " << row["step"];
    // The first evaluation (step 0, before any generation) outlasts the engine's 8 decode steps of
    // 0.25 s: it died inside it.
    if (how == "dies_eval") EXPECT_GT(rows.front()["time/eval"].get<double>(), 8 * 0.25);
    if (!eval) continue;
    for (const int64_t step : {0, 2, 3}) {
      const std::string file = "eval/step_" + std::to_string(step) + ".jsonl";
      ASSERT_EQ(died.lines(file).size(), 10u * 4) << step;
      EXPECT_EQ(by_key(died.lines(file), {"line", "kind", "sample"}), by_key(lived.lines(file), {"line", "kind", "sample"})) << step;
    }
  }
}

TEST(ControllerInProcess, SyncModeTrainsEveryStepOnPolicy) {
  Job job("sync");
  const json summary = json::parse(job.run());
  EXPECT_EQ(summary["event"], "done");
  EXPECT_EQ(summary["steps"], 6);
  EXPECT_EQ(summary["weight_version"], 6);
  const auto recs = job.records();
  ASSERT_EQ(recs.size(), 6u * 4 * 2);
  int64_t response_tokens = 0;
  for (const auto& r : recs) {
    EXPECT_EQ(r["lag"], 0) << r.dump();
    EXPECT_EQ(r["trained_version"], r["step"].get<int>() - 1);
    EXPECT_EQ(r["version_runs"].size(), 1u);
    response_tokens += r["response_len"].get<int64_t>();
  }
  // Every sample once, in ordinal order step by step: step j trains ordinals [4(j-1), 4j).
  std::set<std::pair<int64_t, int64_t>> seen;
  for (const auto& r : recs) {
    EXPECT_EQ(r["ordinal"].get<int64_t>() / 4, r["step"].get<int64_t>() - 1);
    EXPECT_TRUE(seen.insert({r["ordinal"].get<int64_t>(), r["sample"].get<int64_t>()}).second) << "twice: " << r.dump();
  }
  // The actor trained each sample's tokens once (one epoch), and synced after every step.
  EXPECT_EQ(job.trained(Role::kActor), response_tokens);
  int64_t syncs = 0;
  for (auto* t : job.trainers) syncs += t->syncs();
  EXPECT_EQ(syncs, 6);
  const auto metrics = job.lines("metrics.jsonl");
  ASSERT_EQ(metrics.size(), 6u);
  for (const char* k : {"reward/mean", "staleness/lag_0", "mismatch/kl", "idle/actor", "time/generate", "actor/loss",
                        "throughput/generate_tokens_per_s", "rollout/stale_dropped_groups"})
    EXPECT_TRUE(metrics.back().contains(k)) << k;
  // The synthetic actor gives the engine's log-probs: no mismatch.
  EXPECT_NEAR(metrics.back()["mismatch/kl"].get<double>(), 0.0, 1e-6);
}

TEST(ControllerInProcess, AsyncModeBoundsTheLagOfEveryTrainedSample) {
  for (int64_t k : {1, 2}) {
    Job job("async_k" + std::to_string(k));
    job.cfg.rollout.mode = RolloutMode::kAsync;
    job.cfg.rollout.max_staleness = k;
    job.run();
    const auto recs = job.records();
    ASSERT_EQ(recs.size(), 6u * 4 * 2) << "k " << k;
    int64_t lagged = 0;
    for (const auto& r : recs) {
      EXPECT_LE(r["lag"].get<int64_t>(), k) << r.dump();
      EXPECT_EQ(r["version_runs"].size(), 1u) << "without partial rollouts no sample spans a sync";
      lagged += r["lag"].get<int64_t>() > 0;
    }
    EXPECT_GT(lagged, 0) << "k " << k << ": the engines never ran ahead";
    EXPECT_EQ(job.lines("metrics.jsonl").back()["staleness/lag_max"].get<double>() <= k, true);
  }
}

TEST(ControllerInProcess, PartialRolloutsCarryTokensOfTwoVersions) {
  Job job("partial");
  job.cfg.rollout.mode = RolloutMode::kAsync;
  job.cfg.rollout.max_staleness = 1;
  job.cfg.rollout.partial = true;
  testing::SyntheticEngineOptions eo;
  eo.min_len = 8;
  eo.max_len = 64;
  job.run(eo);
  int64_t spanning = 0;
  for (const auto& r : job.records()) {
    EXPECT_LE(r["lag"].get<int64_t>(), 1) << r.dump();
    const auto& runs = r["version_runs"];
    if (runs.size() < 2) continue;
    ++spanning;
    // Runs start at token 0, rise in position and in version, and the oldest bounds the lag.
    EXPECT_EQ(runs[0][0], 0);
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_GT(runs[i][0].get<int64_t>(), runs[i - 1][0].get<int64_t>());
      EXPECT_GT(runs[i][1].get<int64_t>(), runs[i - 1][1].get<int64_t>());
    }
    EXPECT_EQ(r["lag"].get<int64_t>(), r["trained_version"].get<int64_t>() - runs[0][1].get<int64_t>());
  }
  EXPECT_GT(spanning, 0) << "no sample spanned a weight sync";
}

TEST(ControllerInProcess, DropPolicyDropsGroupsThatWouldLagTooFar) {
  Job job("drop");
  job.cfg.rollout.mode = RolloutMode::kAsync;
  job.cfg.rollout.max_staleness = 1;
  job.cfg.rollout.stale_policy = StalePolicy::kDrop;
  job.cfg.rollout.partial = true;
  job.cfg.train.num_steps = 10;
  testing::SyntheticEngineOptions eo;
  eo.min_len = 1;
  eo.max_len = 200;  // a few very long samples straggle behind many short ones
  eo.max_running = 64;
  job.run(eo);
  const auto recs = job.records();
  EXPECT_EQ(recs.size(), 10u * 4 * 2);
  std::set<int64_t> trained, dropped;
  for (const auto& r : recs) {
    EXPECT_LE(r["lag"].get<int64_t>(), 1) << r.dump();
    trained.insert(r["ordinal"].get<int64_t>());
  }
  for (const auto& r : job.records("dropped_stale")) {
    EXPECT_GT(r["step"].get<int64_t>() - 1 - r["dispatch_version"].get<int64_t>(), 1) << r.dump();
    EXPECT_TRUE(dropped.insert(r["ordinal"].get<int64_t>()).second);
  }
  for (int64_t o : dropped) EXPECT_EQ(trained.count(o), 0u) << "ordinal " << o << " both trained and dropped";
  EXPECT_GT(dropped.size(), 0u) << "no straggler was dropped";
  // Completion order: some group trained before one dispatched earlier.
  bool overtaken = false;
  int64_t last = -1;
  for (const auto& r : recs) {
    if (r["ordinal"].get<int64_t>() < last) overtaken = true;
    last = std::max(last, r["ordinal"].get<int64_t>());
  }
  EXPECT_TRUE(overtaken);
}

TEST(ControllerInProcess, DynamicSamplingTrainsOnlyInformativeGroups) {
  Job job("filter");
  job.cfg.rollout.filter_groups = true;
  // Every third prompt's samples all score 1: no signal.
  job.reward = [](const data::Prompt& p, const engine::SampleOutput& s) {
    return (p.line % 3 == 0) ? 1.0 : static_cast<double>(s.sample);
  };
  job.run();
  const auto recs = job.records();
  ASSERT_EQ(recs.size(), 6u * 4 * 2) << "every step still has batch_size groups";
  std::map<std::pair<int64_t, int64_t>, std::set<double>> scores;  // (step, ordinal) -> scores
  for (const auto& r : recs) scores[{r["step"].get<int64_t>(), r["ordinal"].get<int64_t>()}].insert(r["score"].get<double>());
  for (const auto& [k, s] : scores) EXPECT_GT(s.size(), 1u) << "a uniform group was trained: ordinal " << k.second;
  const auto filtered = job.records("filtered");
  EXPECT_GT(filtered.size(), 0u);
  for (const auto& r : filtered) EXPECT_EQ(r["prompt_line"].get<int64_t>() % 3, 0);
  double count = 0;
  for (const auto& m : job.lines("metrics.jsonl")) count += m["rollout/filtered_groups"].get<double>();
  EXPECT_EQ(count, static_cast<double>(filtered.size()));
}

// train.step_hooks: a registered hook drops each step's group of the lowest prompt line and shifts
// every score by 10 (after scoring, before the advantages), adds a metric at each step's end and
// stops the run after step 3, and sees each committed checkpoint.
std::vector<std::pair<int64_t, std::string>> hook_checkpoints;
const bool hooks_registered = [] {
  StepHookDef d;
  d.after_scoring = [](ScoredStep& s) {
    int64_t lowest = 0;
    for (int64_t g = 1; g < static_cast<int64_t>(s.keep_group->size()); ++g)
      if (s.prompt(g).line < s.prompt(lowest).line) lowest = g;
    (*s.keep_group)[static_cast<size_t>(lowest)] = 0;
    for (float& x : s.rollout->score) x += 10;
  };
  d.step_end = [](StepEnd& e) {
    const bool has_reward = std::any_of(e.metrics->begin(), e.metrics->end(),
                                        [](const auto& m) { return m.first == "reward/mean"; });
    e.add->emplace_back("test_hook/step", has_reward ? static_cast<double>(e.step) : -1.0);
    if (e.step == 3) *e.stop = true;
  };
  d.checkpoint = [](const CheckpointSaved& c) { hook_checkpoints.emplace_back(c.step, c.dir); };
  register_step_hook("test_hooks", d);
  StepHookDef bad;
  bad.after_scoring = [](ScoredStep& s) { s.rollout->score[0] = std::nanf(""); };
  register_step_hook("test_nan_score", bad);
  StepHookDef throws;
  throws.step_end = [](StepEnd&) { throw std::runtime_error("the dashboard is down"); };
  register_step_hook("test_throws", throws);
  return true;
}();

TEST(ControllerInProcess, StepHooksFilterReweightLogStopAndSeeCheckpoints) {
  ASSERT_TRUE(hooks_registered);
  hook_checkpoints.clear();
  Job job("hooks");
  job.cfg.train.step_hooks = "test_hooks";
  job.cfg.checkpoint.dir = job.out + "/ckpt";
  job.cfg.checkpoint.every_steps = 2;
  const json summary = json::parse(job.run());
  EXPECT_EQ(summary["event"], "stopped");
  EXPECT_EQ(summary["steps"], 3);
  const auto trained = job.records();
  const auto filtered = job.records("filtered");
  ASSERT_EQ(trained.size(), 3u * 3 * 2) << "3 steps of 3 kept groups of 2 samples";
  ASSERT_EQ(filtered.size(), 3u);
  for (const auto& r : trained) EXPECT_GE(r["score"].get<double>(), 10.0) << "the reweighted score is trained";
  for (const auto& f : filtered)
    for (const auto& r : trained)
      if (r["step"] == f["step"]) EXPECT_LT(f["prompt_line"].get<int64_t>(), r["prompt_line"].get<int64_t>());
  int64_t tokens = 0;
  for (const auto& r : trained) tokens += r["response_len"].get<int64_t>();
  EXPECT_EQ(job.trained(Role::kActor), tokens) << "the dropped groups are not trained";
  const auto lines = job.lines("metrics.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& m : lines) {
    EXPECT_EQ(m["hooks/dropped_groups"], 1.0);
    EXPECT_EQ(m["rollout/filtered_groups"], 1.0);
    EXPECT_EQ(m["test_hook/step"], m["step"].get<double>());
  }
  // Step 2 (checkpoint.every_steps) and step 3 (saved because the hook stopped the run).
  ASSERT_EQ(hook_checkpoints.size(), 2u);
  EXPECT_EQ(hook_checkpoints[0].first, 2);
  EXPECT_EQ(hook_checkpoints[1].first, 3);
  EXPECT_TRUE(std::filesystem::exists(hook_checkpoints[1].second + "/controller.json"));

  // What a hook does wrong ends the job naming the hook; an unknown name is refused up front.
  std::string error;
  Job nan("hooks_nan");
  nan.cfg.train.step_hooks = "test_nan_score";
  nan.run({}, &error);
  EXPECT_NE(error.find("step hook 'test_nan_score' (after_scoring): sample 0 (prompt group 0) has the score nan"),
            std::string::npos) << error;
  Job thrower("hooks_throw");
  thrower.cfg.train.step_hooks = "test_hooks, test_throws";
  thrower.run({}, &error);
  EXPECT_EQ(error, "step hook 'test_throws' (step_end): the dashboard is down");
  EXPECT_EQ(error_of([] { parse_step_hooks("test_hookz"); }),
            "train.step_hooks = 'test_hookz': not a registered step hook (registered: test_hooks, test_nan_score, "
            "test_throws); did you mean 'test_hooks'?");
  EXPECT_EQ(error_of([] { parse_step_hooks("test_hooks,test_hooks"); }),
            "train.step_hooks = 'test_hooks,test_hooks': 'test_hooks' is named twice; name each hook once");
}

// reward.type scorer: a batch scorer registered by name is the one the job's rewards use, made by
// its factory from the config (reward.scorer_args, scorer_batch_size, scorer_concurrency); the
// built-ins remote and python are in the same registry; what is wrong is named.
class LengthScorer final : public reward::BatchScorer {
 public:
  explicit LengthScorer(double per_char) : per_char_(per_char) {}
  reward::BatchScores score(uint64_t, const std::vector<reward::RewardSample>& samples) override {
    reward::BatchScores out;
    for (const auto& s : samples) out.scores.push_back(per_char_ * static_cast<double>(s.response.size()));
    out.extras["chars"] = {0.0, 0};
    for (const auto& s : samples) {
      out.extras["chars"].first += static_cast<double>(s.response.size());
      out.extras["chars"].second += 1;
    }
    return out;
  }
  std::string kind() const override { return "test_length"; }
  std::string where() const override { return "test_length scorer"; }

 private:
  double per_char_;
};

TEST(Rewards, ARegisteredBatchScorerIsTheOneTheJobUses) {
  static const bool registered = [] {
    reward::BatchScorerDef d;
    d.make = [](const JobConfig& c) {
      TILLER_CHECK(c.reward.scorer_args.rfind("per_char=", 0) == 0, "scorer_args '{}'", c.reward.scorer_args);
      return reward::ScorerSetup{std::make_shared<LengthScorer>(std::stod(c.reward.scorer_args.substr(9))),
                                 static_cast<int>(c.reward.scorer_batch_size),
                                 static_cast<int>(c.reward.scorer_concurrency)};
    };
    d.summary = "0.5 a character";
    reward::register_batch_scorer("test_length", d);
    reward::BatchScorerDef none;
    none.make = [](const JobConfig&) { return reward::ScorerSetup{}; };
    reward::register_batch_scorer("test_none", none);
    return true;
  }();
  ASSERT_TRUE(registered);
  JobConfig cfg;
  cfg.reward.type = RewardType::kScorer;
  cfg.reward.scorer = "test_length";
  cfg.reward.scorer_args = "per_char=0.25";
  cfg.reward.scorer_batch_size = 2;
  cfg.reward.scorer_concurrency = 2;
  cfg.validate();
  auto decode = [](const std::vector<int64_t>& ids) { return std::string(ids.size(), 'x'); };
  JobRewards r = make_job_rewards(cfg, decode);
  ASSERT_NE(r.sources.batched, nullptr);
  EXPECT_FALSE(r.sources.rule);
  EXPECT_EQ(r.sources.batched->scorer().kind(), "test_length");
  r.sources.batched->begin_step(1);
  for (uint64_t i = 0; i < 5; ++i) {
    reward::RewardSample s;
    s.id = i;
    s.response = std::string(i * 4, 'a');
    r.sources.batched->add(s);
  }
  std::map<uint64_t, double> got;
  for (auto [id, score] : r.sources.batched->finish(Deadline::after_seconds(30))) got[id] = score;
  ASSERT_EQ(got.size(), 5u);
  for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(got[i], 0.25 * 4 * static_cast<double>(i)) << i;
  EXPECT_EQ(r.sources.batched->take_stats().calls, 3) << "batches of reward.scorer_batch_size = 2";

  // The built-ins are in the same registry; the rule reward is not a batch scorer.
  const auto names = reward::batch_scorer_names();
  for (const char* n : {"python", "remote", "test_length"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  JobConfig rule;
  rule.reward.rule = "toy_digits";
  JobRewards rr = make_job_rewards(rule, decode);
  EXPECT_TRUE(rr.sources.rule);
  EXPECT_EQ(rr.sources.batched, nullptr);
  EXPECT_EQ(reward::job_batch_scorer(rule), "");

  cfg.reward.scorer = "test_lenght";
  EXPECT_NE(error_of([&] { make_job_rewards(cfg, decode); })
                .find("reward.scorer = 'test_lenght': not a registered batch scorer (registered: "),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_job_rewards(cfg, decode); }).find("did you mean 'test_length'?"), std::string::npos);
  cfg.reward.scorer = "test_none";
  EXPECT_EQ(error_of([&] { make_job_rewards(cfg, decode); }), "batch scorer 'test_none': its factory returned no scorer");
  JobConfig unset;
  unset.reward.type = RewardType::kScorer;
  EXPECT_EQ(error_of([&] { unset.validate(); }),
            "reward.type = scorer needs reward.scorer: the name of a batch scorer a trainer of your own registers");
}

TEST(ControllerInProcess, DynamicSamplingStopsAtItsCap) {
  Job job("filter_cap");
  job.cfg.rollout.filter_groups = true;
  job.cfg.rollout.filter_max_extra_batches = 1;
  job.cfg.train.num_steps = 2;
  job.reward = [](const data::Prompt&, const engine::SampleOutput&) { return 1.0; };  // never informative
  const json summary = json::parse(job.run());
  EXPECT_EQ(summary["steps"], 2);
  EXPECT_EQ(summary["weight_version"], 0) << "nothing to train: no update, no sync";
  EXPECT_TRUE(job.records().empty());
  for (const auto& m : job.lines("metrics.jsonl")) {
    EXPECT_EQ(m["rollout/filter_cap_reached"], 1.0);
    EXPECT_EQ(m["rollout/filtered_groups"], 4.0);  // 1 x batch_size extra prompts
  }
}

TEST(ControllerInProcess, PpoWithACriticTrainsBothRoles) {
  Job job("ppo", /*critic=*/true);
  job.cfg.rollout.mode = RolloutMode::kAsync;
  job.cfg.algo.ppo_epochs = 2;
  job.run();
  int64_t tokens = 0;
  for (const auto& r : job.records()) tokens += r["response_len"].get<int64_t>();
  EXPECT_EQ(job.trained(Role::kActor), 2 * tokens);  // two epochs
  EXPECT_EQ(job.trained(Role::kCritic), 2 * tokens);
  const auto m = job.lines("metrics.jsonl").back();
  EXPECT_TRUE(m.contains("critic/loss"));
  EXPECT_NEAR(m["values/mean"].get<double>(), 0.5, 1e-6);
}

// A hung engine: the error names it and what it still owes, once timeouts.generate_s has passed
// on the controller's clock without a sample from it (moved by the synthetic engines' steps, so
// the test waits for nothing).
TEST(ControllerInProcess, AStalledEngineIsNamedWithWhatItOwes) {
  Job job("stalled");
  job.cfg.timeouts.generate_s = 30;
  ManualClock clock;
  testing::SyntheticEngineOptions eo;
  eo.clock = &clock;
  eo.seconds_per_step = 0.25;
  eo.stalled_engine = 1;
  const auto start = clock.now();
  std::string error;
  job.run(eo, &error);
  EXPECT_NE(error.find("generation stalled (timeouts.generate_s = 30 s): synthetic engine 1 has 4 samples of 2 "
                       "prompts in flight and returned none for 30 s"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find("synthetic engine 0"), std::string::npos) << error;  // engine 0 kept returning samples
  const double waited = std::chrono::duration<double>(clock.now() - start).count();
  EXPECT_GE(waited, 30.0);
  EXPECT_LT(waited, 31.0);
}

// A slow disk: a trainer rank still writing its shards when the save's deadline passes (on the
// controller's clock, moved by the rank here) ends the job naming the rank and the save, and the
// step is not committed.
TEST(ControllerInProcess, ASaveSlowerThanItsDeadlineIsNamedAndNotCommitted) {
  Job job("slow_save");
  job.cfg.checkpoint.dir = job.out + "/ckpt";
  job.cfg.checkpoint.every_steps = 2;
  job.cfg.timeouts.collective_s = 10;  // the save's deadline is 4x this
  job.make_plan();
  ManualClock clock;
  testing::SyntheticTrainer actor(job.plan.ranks[1].trainer_roles);
  struct SlowDisk final : wire::RankEndpoint {
    testing::SyntheticTrainer* t;
    ManualClock* clock;
    int saves = 0;
    bool stuck = false;
    std::vector<wire::Frame> handle(wire::Frame f) override {
      if (stuck) return {};  // still writing: what came after the save waits behind it
      if (f.op == wire::Op::kSave && ++saves == 2) {  // the second save does not finish in time
        clock->advance(41);
        stuck = true;
        return {};
      }
      return t->handle(std::move(f));
    }
  } slow;
  slow.t = &actor;
  slow.clock = &clock;
  const std::string error = job.run_with_actor(slow, &clock);
  EXPECT_NE(error.find("rank 1 (actor+ref) did not answer the checkpoint save within 40 s"), std::string::npos)
      << error;
  zero::RunCheckpoints m(job.cfg.checkpoint.dir, 2);
  ASSERT_EQ(m.list().size(), 1u);
  EXPECT_EQ(m.latest()->second.step, 2);
  EXPECT_EQ(m.remove_incomplete(), std::vector<std::string>{"step_000004"});
}

TEST(ControllerInProcess, ATrainerRankFailureNamesTheRankAndTheCall) {
  Job job("failing");
  job.make_plan();
  testing::SyntheticTrainer actor(job.plan.ranks[1].trainer_roles);
  struct ActorThatFails final : wire::RankEndpoint {
    testing::SyntheticTrainer* t;
    std::vector<wire::Frame> handle(wire::Frame f) override {
      if (f.op == wire::Op::kStep) throw Error("CUDA out of memory");
      return t->handle(std::move(f));
    }
  } failing;
  failing.t = &actor;
  const std::string error = job.run_with_actor(failing);
  EXPECT_NE(error.find("rank 1 (actor+ref) failed during the actor's update: CUDA out of memory"), std::string::npos)
      << error;
}

}  // namespace
}  // namespace tiller::controller
