// The controller's parts without mpirun: advantages and off-policy weights against hand-computed
// values, checkpoints on disk, and the collector, training dispatch and the whole controller over
// an in-process channel to synthetic trainer ranks and synthetic engines (src/testing/synthetic.h),
// with the real packer, host arrays, protocol and algorithms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "../common/error_of.h"
#include "../core/faulty_file_system.h"
#include "controller/advantages.h"
#include "controller/checkpoint_manager.h"
#include "controller/controller.h"
#include "controller/job_rewards.h"
#include "controller/off_policy.h"
#include "controller/training_dispatch.h"
#include "job/supervisor.h"
#include "testing/synthetic.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/env/environment.h"
#include "tiller/reward/scorer_registry.h"
#include "tiller/rollout/sample_loop.h"
#include "tiller/rollout/step_hooks.h"

namespace tiller::rollout {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string scratch(const std::string& name) {
  const std::string d = std::string(TILLER_TEST_SCRATCH) + "/controller/" + name;
  remove_tree(d);  // libtorch's std::filesystem::remove_all crashes on the GPU host
  fs::create_directories(d);
  return d;
}

// Adds a sample with `len` response tokens to `ro`: group `g`, sample `s`, a 2-token prompt.
int64_t add_sample(Rollout& ro, int64_t g, int64_t s, int64_t len, float score) {
  std::vector<int64_t> resp(static_cast<size_t>(len), 7);
  const int64_t id = ro.add(g, s, {1, 2}, resp, std::vector<float>(static_cast<size_t>(len), -1.f), false, {}, {}, 0);
  ro.score[static_cast<size_t>(id)] = score;
  return id;
}

void expect_near(const std::vector<float>& got, const std::vector<double>& want, double tol = 1e-5) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

double metric(const Metrics& m, const std::string& key) {
  for (const auto& [k, v] : m)
    if (k == key) return v;
  ADD_FAILURE() << "no metric " << key;
  return 0;
}

// --- advantages ----------------------------------------------------------------------------------

// Two prompts of two samples each, arriving out of order: (prompt, sample, length, score).
Rollout two_groups() {
  Rollout ro;
  add_sample(ro, 1, 1, 2, 0.5f);
  add_sample(ro, 0, 0, 2, 1.0f);
  add_sample(ro, 1, 0, 1, 0.5f);
  add_sample(ro, 0, 1, 1, 0.0f);
  return ro;
}

AdvantageSpec group_spec(const std::string& e) {
  AdvantageSpec s;
  s.estimator = e;
  s.n = 2;
  s.whiten = false;
  return s;
}

TEST(Advantages, GroupBaselinesEqualTheHandComputedValues) {
  const Rollout ro = two_groups();  // token order: (1,1)x2, (0,0)x2, (1,0), (0,1)
  // GRPO: prompt 0 scores {1, 0}: mean 0.5, std (Bessel) sqrt(0.5) -> +-0.5 / 0.70711; prompt 1: 0.
  const double z = 0.5 / (std::sqrt(0.5) + 1e-6);
  expect_near(compute_advantages(ro, group_spec("group_norm"), {}).advantages, {0, 0, z, z, 0, -z});
  // RLOO: r_i minus the mean of the other: {1 - 0, 0 - 1} and {0, 0}.
  expect_near(compute_advantages(ro, group_spec("rloo"), {}).advantages, {0, 0, 1, 1, 0, -1});
  // REINFORCE with baseline and Dr.GRPO: minus the group mean.
  for (auto e : {"reinforce_baseline", "dr_grpo"})
    expect_near(compute_advantages(ro, group_spec(e), {}).advantages, {0, 0, 0.5, 0.5, 0, -0.5});
}

TEST(Advantages, WhiteningSkipsOnlyGrpoAndDrGrpo) {
  const Rollout ro = two_groups();
  for (auto e : {"rloo", "reinforce_baseline"}) {
    AdvantageSpec s = group_spec(e);
    s.whiten = true;
    const auto a = compute_advantages(ro, s, {}).advantages;
    double mean = 0;
    for (float v : a) mean += v;
    EXPECT_NEAR(mean / a.size(), 0.0, 1e-5) << e;  // whitened
  }
  AdvantageSpec s = group_spec("dr_grpo");
  s.whiten = true;
  expect_near(compute_advantages(ro, s, {}).advantages, {0, 0, 0.5, 0.5, 0, -0.5});
}

// A user's estimator, registered by name, is the one compute_advantages runs: 3 x score - 1 on every
// token of the sample, values no built-in gives; its record (normalized) turns whitening off, and
// as a group estimator it is handed the groups' order.
TEST(Advantages, ARegisteredEstimatorIsTheOneUsed) {
  static const bool registered = [] {
    algo::AdvantageEstimatorDef d;
    d.group_baseline = true;
    d.normalized = true;
    d.compute = [](const algo::AdvantageInputs& in) {
      if (!in.group_order.defined() || in.n != 2 || in.values.defined())
        throw Error("the inputs of a group estimator without a critic are not what they should be");
      const at::Tensor a = algo::per_token(in.scores * 3 - 1, in.cu);
      return algo::AdvantageOutputs{a, a};
    };
    algo::register_advantage_estimator("test_three_score_minus_one", d);
    return true;
  }();
  ASSERT_TRUE(registered);
  const Rollout ro = two_groups();  // scores 0.5 (2 tokens), 1.0 (2), 0.5 (1), 0.0 (1)
  AdvantageSpec s = group_spec("test_three_score_minus_one");
  s.whiten = true;
  expect_near(compute_advantages(ro, s, {}).advantages, {0.5, 0.5, 2, 2, 0.5, -1});
  // Its outputs are checked: one float per token, or a clear error naming it.
  static const bool short_one = [] {
    algo::AdvantageEstimatorDef d;
    d.compute = [](const algo::AdvantageInputs& in) {
      const at::Tensor a = at::zeros({in.rewards.numel() - 1});
      return algo::AdvantageOutputs{a, a};
    };
    algo::register_advantage_estimator("test_one_short", d);
    return true;
  }();
  ASSERT_TRUE(short_one);
  s = group_spec("test_one_short");
  EXPECT_EQ(error_of([&] { compute_advantages(ro, s, {}); }),
            "advantage estimator test_one_short: its advantages are 5 elements for 6 tokens; return one float per "
            "token");
}

TEST(Advantages, GaeAndReinforceWithTheKlInTheReward) {
  // One sample of 2 tokens: logp [-1, -2], ref [-1.5, -2]: k1 KL [0.5, 0]; score 1, kl_coef 0.1:
  // token rewards [-0.05, 1.0]. Values [0.5, 0.6], gamma = lambda = 1: returns [0.95, 1.0],
  // advantages = returns - values = [0.45, 0.4].
  Rollout ro(RolloutLayout{true, true});
  add_sample(ro, 0, 0, 2, 1.0f);
  ro.logp = {-1.f, -2.f};
  ro.ref_logp = {-1.5f, -2.f};
  ro.values = {0.5f, 0.6f};
  AdvantageSpec s;
  s.estimator = "gae";
  s.have_ref = true;
  s.gamma = s.lambda = 1.0;
  s.whiten = false;
  const AdvantageResult r = compute_advantages(ro, s, {0.1, {}});
  expect_near(r.advantages, {0.45, 0.4});
  expect_near(r.returns, {0.95, 1.0});
  EXPECT_NEAR(r.kl_mean_per_sample, 0.5, 1e-6);
  EXPECT_NEAR(metric(r.metrics, "kl/coef"), 0.1, 1e-12);
  // REINFORCE++, gamma 0.5: [-0.05 + 0.5 * 1.0, 1.0].
  s.estimator = "reinforce";
  s.gamma = 0.5;
  expect_near(compute_advantages(ro, s, {0.1, {}}).advantages, {0.45, 1.0});
}

TEST(Advantages, RewardShapingAndItsState) {
  // DAPO's overlong penalty: max_new_tokens 10, buffer 4, penalty 1.
  EXPECT_EQ(overlong_penalty(6, 10, 4, 1.0), 0.0);
  EXPECT_NEAR(overlong_penalty(8, 10, 4, 1.0), -0.5, 1e-12);
  EXPECT_EQ(overlong_penalty(10, 10, 4, 1.0), -1.0);
  EXPECT_EQ(overlong_penalty(10, 10, 0, 1.0), 0.0);
  Rollout ro;
  add_sample(ro, 0, 0, 8, 1.0f);
  add_sample(ro, 0, 1, 2, 1.0f);
  AdvantageSpec s = group_spec("dr_grpo");
  s.max_new_tokens = 10;
  s.overlong_buffer = 4;
  // Scores 1 - 0.5 and 1: mean 0.75 -> [-0.25] x 8 and [0.25] x 2.
  const AdvantageResult r = compute_advantages(ro, s, {});
  expect_near(r.advantages, {-0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, 0.25, 0.25});
  EXPECT_NEAR(metric(r.metrics, "reward/mean"), 1.0, 1e-9);  // reported before shaping
  EXPECT_NEAR(metric(r.metrics, "reward/overlong_penalized_fraction"), 0.5, 1e-9);
  // Normalisation updates the moments it returns and leaves the input state alone.
  s.normalize_rewards = true;
  const AdvantageState in;
  const AdvantageResult n = compute_advantages(ro, s, in);
  EXPECT_EQ(in.reward_moments.count(), 0);
  EXPECT_EQ(n.state.reward_moments.count(), 2);
  EXPECT_NEAR(n.state.reward_moments.mean(), 0.75, 1e-9);
}

// --- off-policy ----------------------------------------------------------------------------------

TEST(OffPolicy, WeightsMasksAndMismatch) {
  // d = proximal - behaviour per token: sample 0 [ln 3, 0], sample 1 [-ln 4].
  Rollout ro;
  add_sample(ro, 0, 0, 2, 0);
  add_sample(ro, 0, 1, 1, 0);
  ro.engine_logp = {-2.f, -1.f, -1.f};
  ro.logp = {static_cast<float>(-2 + std::log(3.0)), -1.f, static_cast<float>(-1 - std::log(4.0))};
  const OffPolicy tis = off_policy(ro, {ImportanceCorrection::kTis, 2.0, 0});
  expect_near(tis.weights, {2.0, 1.0, 0.25});
  EXPECT_EQ(metric(tis.metrics, "off_policy/truncated_tokens"), 1);
  const OffPolicy dec = off_policy(ro, {ImportanceCorrection::kDecoupled, 2.0, 0});
  expect_near(dec.weights, {0.0, 1.0, 0.25});  // 3 > cap: masked
  EXPECT_EQ(metric(dec.metrics, "off_policy/masked_tokens"), 1);
  EXPECT_TRUE(off_policy(ro, {ImportanceCorrection::kNone, 0, 0}).weights.empty());
  // Geometric means: sample 0 sqrt(3) = 1.73, sample 1 0.25: with r = 2 only sample 1 is out.
  const OffPolicy mask = off_policy(ro, {ImportanceCorrection::kNone, 0, 2.0});
  EXPECT_EQ(mask.masked, (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(mask.masked_samples, 1);
  // k3 of KL(behaviour || proximal) per token: mean of exp(d) - 1 - d.
  const double kl = ((3 - 1 - std::log(3.0)) + 0 + (0.25 - 1 + std::log(4.0))) / 3;
  EXPECT_NEAR(metric(tis.metrics, "mismatch/kl"), kl, 1e-6);
  EXPECT_NEAR(metric(tis.metrics, "mismatch/max_abs_logp_diff"), std::log(4.0), 1e-6);
}

// --- checkpoints ---------------------------------------------------------------------------------

TEST(Checkpoints, CompleteOnlyOnceCommittedAndPrunedToKeepLast) {
  const std::string root = scratch("ckpt");
  CheckpointManager m(root, 2);
  ControllerState st;
  st.weight_version = 3;
  st.outstanding = {{17, 4}, {18, 9}};
  st.next_ordinal = 19;
  for (int64_t s : {1, 2, 3}) {
    m.begin(s);
    EXPECT_EQ(m.list().size(), static_cast<size_t>(std::min<int64_t>(s - 1, 2))) << "step " << s << " counts early";
    st.step = s;
    m.commit(s, st);
  }
  const auto all = m.list();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].step, 2);
  EXPECT_FALSE(fs::exists(m.dir(1)));
  const auto latest = m.latest();
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->first.step, 3);
  EXPECT_EQ(latest->second.step, 3);
  EXPECT_EQ(latest->second.weight_version, 3u);
  ASSERT_EQ(latest->second.outstanding.size(), 2u);
  EXPECT_EQ(latest->second.outstanding[1].ordinal, 18);
  EXPECT_EQ(latest->second.outstanding[1].dataset_index, 9);
  EXPECT_EQ(latest->second.next_ordinal, 19);
  // A begun, uncommitted step 4 is not a checkpoint.
  m.begin(4);
  EXPECT_EQ(m.latest()->first.step, 3);
}

// controller.json is the commit: under a full disk, a failed rename or a failed fsync while it is
// written, the step stays incomplete and the one before stays the newest, and the leftovers of the
// cut-short save are what remove_incomplete() clears.
TEST(Checkpoints, AFaultWhileCommittingLeavesThePreviousCheckpoint) {
  const std::string root = scratch("ckpt_faults");
  CheckpointManager m(root, 3);
  ControllerState st;
  st.step = 1;
  m.begin(1);
  m.commit(1, st);
  int step = 1;
  for (const char* fault : {"disk", "rename", "sync"}) {
    ++step;
    test::FaultyFileSystem faulty;
    if (std::string(fault) == "disk") {
      faulty.full_disk_in = "controller.json";
      faulty.disk_left = 10;
    }
    if (std::string(fault) == "rename") faulty.fail_rename_to = "controller.json";
    if (std::string(fault) == "sync") faulty.fail_sync_in = "controller.json";
    m.begin(step);
    st.step = step;
    {
      FileSystem::Override use(faulty);
      EXPECT_THROW(m.commit(step, st), IoError) << fault;
    }
    EXPECT_EQ(faulty.faults, 1) << fault;
    ASSERT_EQ(m.list().size(), 1u) << fault;
    EXPECT_EQ(m.latest()->second.step, 1) << fault;
  }
  EXPECT_EQ(m.remove_incomplete(), (std::vector<std::string>{"step_000002", "step_000003", "step_000004"}));
  EXPECT_EQ(m.list().size(), 1u);
}

TEST(Checkpoints, AStrayStepNameIsRefusedByName) {
  const std::string root = scratch("ckpt_names");
  fs::create_directories(root + "/step_000002.tmp-123");  // a temporary: ignored
  fs::create_directories(root + "/notes");                // not ours: ignored
  CheckpointManager m(root, 2);
  EXPECT_TRUE(m.list().empty());
  fs::create_directories(root + "/step_final");
  try {
    m.list();
    FAIL() << "step_final was taken for a checkpoint";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'step_final' is not a checkpoint name"), std::string::npos) << e.what();
  }
  remove_tree(root + "/step_final");
  fs::create_directories(root + "/step_99999999999999999999");  // would overflow
  EXPECT_THROW(m.list(), ConfigError);
}

TEST(Checkpoints, StateOfTheFirstFormatLoadsWithNothingInFlight) {
  const std::string v1 = R"({"format":"tiller-controller-1","step":4,"weight_version":4,"actor_updates":8,
    "critic_updates":8,"dataset":{"epoch":0,"position":64,"size":256},"kl_coef":0.01,
    "reward_moments":{"mean":0,"m2":0,"count":0}})";
  const ControllerState s = ControllerState::from_json(v1, "c.json");
  EXPECT_EQ(s.step, 4);
  EXPECT_TRUE(s.outstanding.empty());
  EXPECT_EQ(s.next_ordinal, 0);
  EXPECT_THROW(ControllerState::from_json("{\"format\":\"other\"}", "c.json"), IoError);
  EXPECT_THROW(ControllerState::from_json("{\"format\":\"tiller-controller-2\",\"step\":1}", "c.json"), IoError);
  EXPECT_THROW(ControllerState::from_json("not json", "c.json"), IoError);
}

// --- the controller over an in-process channel ----------------------------------------------------

// A GRPO or PPO job on the synthetic stand-ins: ranks 1.. hold the trainer roles, engines answer
// only Stop. The rule reward is the share of even ids in the response (or what `reward` says).
struct Job {
  JobConfig cfg;
  dist::RankPlan plan;
  std::vector<std::unique_ptr<RankEndpoint>> endpoints;
  std::vector<SyntheticTrainer*> trainers;
  std::unique_ptr<LocalChannel> channel;
  std::unique_ptr<SyntheticEngines> engines;
  std::unique_ptr<SyntheticPrompts> prompts;
  std::function<double(const Prompt&, const engine::SampleOutput&)> reward;
  LoopSources loop;  // multi-turn jobs: the environment
  std::string out;

  explicit Job(const std::string& name, bool critic = false) {
    out = scratch(name);
    cfg.roles.actor.model = "unused";
    cfg.roles.critic.enabled = critic;
    cfg.algo.advantage_estimator = critic ? "gae" : "group_norm";
    cfg.rollout.batch_size = 4;
    cfg.rollout.n_samples_per_prompt = 2;
    cfg.rollout.max_new_tokens = 64;
    cfg.rollout.micro_batch_tokens = 64;
    cfg.train.train_batch_size = 4;
    cfg.train.micro_batch_tokens = 64;
    cfg.train.num_steps = 6;
    cfg.engines.count = 2;
    cfg.engines.max_num_seqs = 4;
    cfg.run.output_dir = out;
    cfg.checkpoint.dir = "";
    cfg.logging.rollout_records = out + "/records.jsonl";
    cfg.timeouts.generate_s = 30;
    reward = [](const Prompt&, const engine::SampleOutput& s) {
      double even = 0;
      for (int64_t t : s.tokens) even += t % 2 == 0;
      return s.tokens.empty() ? 0.0 : even / static_cast<double>(s.tokens.size());
    };
  }

  // Validates the config and places every rank on one host.
  void make_plan() {
    cfg.validate();
    dist::NodeMap nodes;
    std::vector<int> ranks(static_cast<size_t>(dist::required_world_size(cfg)));
    std::iota(ranks.begin(), ranks.end(), 0);
    nodes.nodes.push_back({"host", ranks, -1});
    plan = dist::make_rank_plan(cfg, nodes);
  }

  // Runs the job with rank 1 (the actor's) answered by `actor` and the engines' ranks by stand-ins
  // (call make_plan() first); returns the message of the Error the run ended with, "" if none.
  std::string run_with_actor(RankEndpoint& actor, const Clock* clock = nullptr) {
    SyntheticEngineRank engine_rank;
    std::vector<RankEndpoint*> raw(static_cast<size_t>(plan.world_size), &engine_rank);
    raw[0] = nullptr;
    raw[1] = &actor;
    LocalChannel channel(raw);
    SyntheticEngineOptions eo;
    eo.engines = 2;
    SyntheticEngines synthetic(eo);
    SyntheticPrompts source(64, 5, eo.vocab);
    ControllerWiring w;
    w.plan = &plan;
    w.engines = &synthetic;
    w.channel = &channel;
    w.prompts = &source;
    w.rewards.rule = reward;
    w.print_summary = false;
    if (clock) w.clock = clock;
    Controller c(cfg, w);
    try {
      c.run();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  // Runs the job; with `error`, a run that throws stores the message there instead of failing.
  std::string run(SyntheticEngineOptions eo = {}, std::string* error = nullptr) {
    make_plan();
    std::vector<RankEndpoint*> raw(static_cast<size_t>(plan.world_size), nullptr);
    for (const auto& a : plan.ranks) {
      if (a.rank == plan.controller) continue;
      if (!a.trainer_roles.empty()) {
        auto t = std::make_unique<SyntheticTrainer>(a.trainer_roles);
        trainers.push_back(t.get());
        endpoints.push_back(std::move(t));
      } else {
        endpoints.push_back(std::make_unique<SyntheticEngineRank>());
      }
      raw[static_cast<size_t>(a.rank)] = endpoints.back().get();
    }
    channel = std::make_unique<LocalChannel>(raw);
    eo.engines = static_cast<size_t>(cfg.engine_count());
    eo.max_running = cfg.engines.max_num_seqs;
    engines = std::make_unique<SyntheticEngines>(eo);
    prompts = std::make_unique<SyntheticPrompts>(64, 5, eo.vocab);
    ControllerWiring w;
    w.plan = &plan;
    w.engines = engines.get();
    w.channel = channel.get();
    w.prompts = prompts.get();
    w.rewards.rule = reward;
    w.loop = loop;
    w.print_summary = false;
    if (eo.clock) w.clock = eo.clock;
    Controller c(cfg, w);
    if (!error) {
      EXPECT_EQ(c.run(), 0);
      return c.summary();
    }
    try {
      c.run();
    } catch (const Error& e) {
      *error = e.what();
    }
    return c.summary();
  }

  std::vector<json> lines(const std::string& file) const {
    std::vector<json> out_lines;
    std::ifstream in(out + "/" + file);
    for (std::string l; std::getline(in, l);) out_lines.push_back(json::parse(l));
    return out_lines;
  }
  std::vector<json> records(const char* event = "trained") const {
    std::vector<json> r;
    for (auto& l : lines("records.jsonl"))
      if (l["event"] == event) r.push_back(l);
    return r;
  }
  int64_t trained(Role r) const {
    int64_t n = 0;
    for (auto* t : trainers) n += t->trained_tokens(r);
    return n;
  }
};

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
  SyntheticEngineOptions eo;
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
  SyntheticEngineOptions eo;
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
  job.reward = [](const Prompt& p, const engine::SampleOutput& s) {
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
  job.reward = [](const Prompt&, const engine::SampleOutput&) { return 1.0; };  // never informative
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
  SyntheticEngineOptions eo;
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
  SyntheticTrainer actor(job.plan.ranks[1].trainer_roles);
  struct SlowDisk final : RankEndpoint {
    SyntheticTrainer* t;
    ManualClock* clock;
    int saves = 0;
    bool stuck = false;
    std::vector<Frame> handle(Frame f) override {
      if (stuck) return {};  // still writing: what came after the save waits behind it
      if (f.op == Op::kSave && ++saves == 2) {  // the second save does not finish in time
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
  CheckpointManager m(job.cfg.checkpoint.dir, 2);
  ASSERT_EQ(m.list().size(), 1u);
  EXPECT_EQ(m.latest()->second.step, 2);
  EXPECT_EQ(m.remove_incomplete(), std::vector<std::string>{"step_000004"});
}

TEST(ControllerInProcess, ATrainerRankFailureNamesTheRankAndTheCall) {
  Job job("failing");
  job.make_plan();
  SyntheticTrainer actor(job.plan.ranks[1].trainer_roles);
  struct ActorThatFails final : RankEndpoint {
    SyntheticTrainer* t;
    std::vector<Frame> handle(Frame f) override {
      if (f.op == Op::kStep) throw Error("CUDA out of memory");
      return t->handle(std::move(f));
    }
  } failing;
  failing.t = &actor;
  const std::string error = job.run_with_actor(failing);
  EXPECT_NE(error.find("rank 1 (actor+ref) failed during the actor's update: CUDA out of memory"), std::string::npos)
      << error;
}

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
    SyntheticEngineOptions eo;
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

// --- sample loops (tiller/rollout/sample_loop.h) ----------------------------------------------------

// A loop of the kind an agent writes: each sample drafts (the group's one request of n), then
// revises once (a request of one sample whose prompt is the prompt, the draft and two marker ids of
// the loop's own), and hands back draft + markers + revision with the markers masked. loop_args
// "marker=<id>" picks the first marker; "twice" finishes sample 0 twice (a broken loop).
class ReviseLoop final : public SampleLoop {
 public:
  explicit ReviseLoop(const SampleLoopContext& c) : host_(*c.host), ctx_(c) {
    const std::string& a = c.job->rollout.loop_args;
    if (a == "twice") {
      twice_ = true;
    } else if (a.rfind("marker=", 0) == 0) {
      marker_ = std::stoll(a.substr(7));
    } else {
      throw ConfigError("rollout.loop_args = '" + a + "': marker=<id> or twice");
    }
  }
  void start(int64_t group) override {
    engine::Request r;
    r.prompt = host_.prompt(group).tokens;
    r.n = ctx_.n;
    r.params = ctx_.sampling;
    r.params.seed = host_.seed(group);
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
    if (twice_ && sample == 0) host_.finish(group, f);
    host_.finish(group, std::move(f));
  }

  LoopHost& host_;
  SampleLoopContext ctx_;
  int64_t marker_ = 0;
  bool twice_ = false;
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
// one, and a loop that finishes a sample twice are refused by name.
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
                .find("rollout.loop = 'test_revis': not a registered sample loop (registered: multi_turn, single_turn, "
                      "test_revise"),
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
}

// --- the supervisor (tiller launch) -----------------------------------------------------------

TEST(Supervisor, DiagnosisTellsCurableFromConfigErrors) {
  EXPECT_EQ(diagnose({0, 0, {}}).verdict, Verdict::kDone);
  // A rank that died: the first error line is the cause, and a restart may cure it.
  const Diagnosis died = diagnose({137, 0, {"[12:00] [info] step 3/8", "tiller: error: rank 2: engine 0 (host:1) "
                                           "stream ended", "tiller: error: rank 0: later noise"}});
  EXPECT_EQ(died.verdict, Verdict::kRestart);
  EXPECT_EQ(died.cause, "tiller: error: rank 2: engine 0 (host:1) stream ended (exit code 137)");
  const Diagnosis killed = diagnose({1, 0, {"mpirun noticed that process rank 3 with PID 7 on node n exited on signal 9 "
                                            "(Killed)."}});
  EXPECT_EQ(killed.verdict, Verdict::kRestart);
  EXPECT_NE(killed.cause.find("exited on signal 9"), std::string::npos);
  // Exit code 2 is a config or usage error, from any rank: never retried.
  EXPECT_EQ(diagnose({2, 0, {"tiller: error: rank 0: data/p: is a directory"}}).verdict, Verdict::kGiveUp);
  EXPECT_EQ(diagnose({1, 0, {"There are not enough slots available in the system"}}).verdict, Verdict::kGiveUp);
  EXPECT_EQ(diagnose({0, 9, {}}).verdict, Verdict::kRestart);
  EXPECT_DOUBLE_EQ(backoff_seconds(1, 10, 300), 10);
  EXPECT_DOUBLE_EQ(backoff_seconds(3, 10, 300), 40);
  EXPECT_DOUBLE_EQ(backoff_seconds(9, 10, 300), 300);
}

// Real processes (sh): a job that fails once is restarted with TILLER_RESTARTS=1 and finishes; an
// incomplete checkpoint a crash left is removed first; a config error (exit 2) is not retried; a
// job that keeps failing stops after max_restarts.
TEST(Supervisor, RestartsACurableFailureAndNothingElse) {
  const std::string d = scratch("supervisor");
  fs::create_directories(d + "/ckpt/step_000002");
  ControllerState st;
  st.step = 2;
  write_file_atomic(d + "/ckpt/step_000002/controller.json", st.to_json());
  fs::create_directories(d + "/ckpt/step_000004/actor");  // cut short: no controller.json
  std::vector<std::string> lines;
  SupervisorOptions o;
  o.checkpoint_dir = d + "/ckpt";
  o.max_restarts = 2;
  o.backoff_first_s = 0.01;
  o.log = [&](const std::string& l) { lines.push_back(l); };
  o.command = {"sh", "-c", "echo run $TILLER_RESTARTS >> " + d + "/runs; if [ ! -e " + d +
                               "/failed ]; then touch " + d + "/failed; echo 'tiller: error: rank 1: boom'; exit 1; fi"};
  EXPECT_EQ(supervise(o), 0);
  EXPECT_EQ(*read_file(d + "/runs"), "run 0\nrun 1\n");
  EXPECT_FALSE(fs::exists(d + "/ckpt/step_000004"));
  EXPECT_TRUE(fs::exists(d + "/ckpt/step_000002/controller.json"));
  auto logged = [&](const std::string& what) {
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };
  EXPECT_TRUE(logged("removed the incomplete checkpoint " + d + "/ckpt/step_000004")) << lines.front();
  EXPECT_TRUE(logged("restart 1/2 in 0 s, from the checkpoint of step 2; cause: tiller: error: rank 1: boom (exit code 1)"));
  EXPECT_TRUE(logged("finished after 1 restart(s)"));

  lines.clear();
  o.command = {"sh", "-c", "echo x >> " + d + "/config_runs; echo 'tiller: error: rank 0: bad key'; exit 2"};
  EXPECT_EQ(supervise(o), 2);
  EXPECT_EQ(*read_file(d + "/config_runs"), "x\n");
  EXPECT_TRUE(logged("not restarting: a config or launch error"));

  lines.clear();
  o.command = {"sh", "-c", "echo x >> " + d + "/always; exit 3"};
  EXPECT_EQ(supervise(o), 3);
  EXPECT_EQ(*read_file(d + "/always"), "x\nx\nx\n");  // the run and its 2 restarts
  EXPECT_TRUE(logged("all 2 restart(s) are used: exit code 3"));
}

}  // namespace
}  // namespace tiller::rollout
