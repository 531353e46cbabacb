// The controller's parts without mpirun: advantages and off-policy weights against hand-computed
// values, checkpoints on disk, and the supervisor of `tiller launch`.
#include "controller_job.h"

namespace tiller::controller {
namespace {

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
  const OffPolicy tis = off_policy(ro, {ImportanceCorrection::kTis, 2.0, 0}, 0);
  expect_near(tis.weights, {2.0, 1.0, 0.25});
  EXPECT_EQ(metric(tis.metrics, "off_policy/truncated_tokens"), 1);
  const OffPolicy dec = off_policy(ro, {ImportanceCorrection::kDecoupled, 2.0, 0}, 0);
  expect_near(dec.weights, {0.0, 1.0, 0.25});  // 3 > cap: masked
  EXPECT_EQ(metric(dec.metrics, "off_policy/masked_tokens"), 1);
  EXPECT_TRUE(off_policy(ro, {ImportanceCorrection::kNone, 0, 0}, 0).weights.empty());
  // Geometric means: sample 0 sqrt(3) = 1.73, sample 1 0.25: with r = 2 only sample 1 is out.
  const OffPolicy mask = off_policy(ro, {ImportanceCorrection::kNone, 0, 2.0}, 0);
  EXPECT_EQ(mask.masked, (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(mask.masked_samples, 1);
  // k3 of KL(behaviour || proximal) per token: mean of exp(d) - 1 - d.
  const double kl = ((3 - 1 - std::log(3.0)) + 0 + (0.25 - 1 + std::log(4.0))) / 3;
  EXPECT_NEAR(metric(tis.metrics, "mismatch/kl"), kl, 1e-6);
  EXPECT_NEAR(metric(tis.metrics, "mismatch/max_abs_logp_diff"), std::log(4.0), 1e-6);
  EXPECT_EQ(metric(tis.metrics, "mismatch/tokens_compared"), 3);
  EXPECT_EQ(metric(tis.metrics, "mismatch/tokens_differing"), 2);
}

// The peers' rollout correction: MIS masks outside [lower, cap]; the sequence levels weigh a
// whole sample by its product of ratios or their geometric mean (truncated or masked as one); the
// veto rejects a sample with a near-impossible token; and the weights' distribution is reported.
TEST(OffPolicy, MaskedLevelsVetoAndTheWeightsDistribution) {
  // d per token: sample 0 [ln 3, 0], sample 1 [-ln 4], sample 2 [ln 1.5, ln 1.5, -ln 1e5].
  Rollout ro;
  add_sample(ro, 0, 0, 2, 0);
  add_sample(ro, 0, 1, 1, 0);
  add_sample(ro, 0, 2, 3, 0);
  ro.engine_logp = {-2.f, -1.f, -1.f, -1.f, -1.f, -1.f};
  const auto lf = [](double d) { return static_cast<float>(-1 + d); };
  ro.logp = {static_cast<float>(-2 + std::log(3.0)), -1.f, lf(-std::log(4.0)), lf(std::log(1.5)), lf(std::log(1.5)),
             lf(-std::log(1e5))};
  OffPolicySpec mis{ImportanceCorrection::kMis, 2.0, 0};
  // Token MIS, lower 1/2: 3 and 0.25 and 1e-5 are out, 1 and 1.5 kept with their weights.
  const OffPolicy m = off_policy(ro, mis, 0);
  expect_near(m.weights, {0.0, 1.0, 0.0, 1.5, 1.5, 0.0});
  EXPECT_EQ(metric(m.metrics, "off_policy/masked_tokens"), 3);
  EXPECT_NEAR(metric(m.metrics, "off_policy/masked_share"), 0.5, 1e-12);
  mis.cap_lower = 0.2;  // 0.25 now kept
  expect_near(off_policy(ro, mis, 0).weights, {0.0, 1.0, 0.25, 1.5, 1.5, 0.0});
  // Sequence level (products 3, 0.25, 2.25e-5), truncated at 2: every token of a sample alike.
  OffPolicySpec seq{ImportanceCorrection::kTis, 2.0, 0, IsLevel::kSequence};
  const OffPolicy sq = off_policy(ro, seq, 0);
  expect_near(sq.weights, {2.0, 2.0, 0.25, 2.25e-5, 2.25e-5, 2.25e-5});
  EXPECT_EQ(metric(sq.metrics, "off_policy/truncated_tokens"), 2);
  // Geometric level masked (MIS, [0.5, 2]): sqrt(3) kept, 0.25 and (2.25e-5)^(1/3) = 0.028 masked.
  OffPolicySpec geo{ImportanceCorrection::kMis, 2.0, 0, IsLevel::kGeometric};
  expect_near(off_policy(ro, geo, 0).weights, {std::sqrt(3.0), std::sqrt(3.0), 0.0, 0.0, 0.0, 0.0}, 1e-6);
  // Veto 1e-4: sample 2 (a token at 1e-5) is rejected; nothing else changes.
  OffPolicySpec veto{ImportanceCorrection::kTis, 2.0, 0};
  veto.veto = 1e-4;
  const OffPolicy v = off_policy(ro, veto, 0);
  EXPECT_EQ(v.masked, (std::vector<uint8_t>{0, 0, 1}));
  EXPECT_EQ(metric(v.metrics, "off_policy/rejected_samples"), 1);
  EXPECT_NEAR(metric(v.metrics, "off_policy/masked_sample_share"), 1.0 / 3, 1e-12);
  expect_near(v.weights, {2.0, 1.0, 0.25, 1.5, 1.5, 1e-5});
  // The token weights' distribution: sorted 1e-5, 0.25, 1, 1.5, 1.5, 3 (to 1%).
  EXPECT_NEAR(metric(v.metrics, "off_policy/is_weight_min"), 1e-5, 1e-7);
  EXPECT_NEAR(metric(v.metrics, "off_policy/is_weight_p50"), 1.5, 0.015);  // zero-based rank ceil(0.5 * 5) = 3
  EXPECT_NEAR(metric(v.metrics, "off_policy/is_weight_max"), 3.0, 0.03);
  EXPECT_NEAR(metric(v.metrics, "off_policy/is_weight_p95"), 3.0, 0.03);
  const double sum = 1e-5 + 0.25 + 1 + 1.5 + 1.5 + 3, sq_sum = 1e-10 + 0.0625 + 1 + 2.25 + 2.25 + 9;
  EXPECT_NEAR(metric(v.metrics, "off_policy/is_ess"), sum * sum / (6 * sq_sum), 1e-7);
  const double k1 = -(std::log(3.0) - std::log(4.0) + 2 * std::log(1.5) - std::log(1e5)) / 6;
  EXPECT_NEAR(metric(v.metrics, "off_policy/mismatch_k1"), k1, 1e-6);
}

// The bitwise count compares the tokens the scoring weights drew, to the bit: a sample whose first
// two tokens came from version 4 and the rest from version 5, scored with version 5.
TEST(OffPolicy, TokensDifferingCountsTheScoringVersionsTokensBitForBit) {
  Rollout ro;
  ro.add(0, 0, {1, 2}, {7, 7, 7, 7, 7}, {-1.f, -2.f, -3.f, -4.f, -5.f}, false, {0, 2}, {4, 5}, 5);
  add_sample(ro, 0, 1, 2, 0);  // all of version 0: not compared
  ro.logp = {-1.f, -2.5f, -3.f, std::nextafter(-4.f, 0.f), -5.f, 0.f, 0.f};
  const OffPolicy o = off_policy(ro, {}, 5);
  EXPECT_EQ(metric(o.metrics, "mismatch/tokens_compared"), 3);
  EXPECT_EQ(metric(o.metrics, "mismatch/tokens_differing"), 1);  // one ulp is a difference
  // The mismatch is the version-5 tokens' alone (one ulp at most); the lag, the others': tokens
  // 0-1 of version 4 (d = 0, -0.5) and the version-0 sample's 2 tokens (d = 1 each).
  EXPECT_LT(metric(o.metrics, "mismatch/max_abs_logp_diff"), 1e-6);
  EXPECT_NEAR(metric(o.metrics, "lag/max_abs_logp_diff"), 1.0, 1e-6);
  EXPECT_EQ(metric(o.metrics, "lag/tokens"), 4);
  EXPECT_NEAR(metric(o.metrics, "lag/kl"), ((std::exp(-0.5) - 1 + 0.5) + 2 * (std::exp(1.0) - 2)) / 4, 1e-6);
}

// --- checkpoints ---------------------------------------------------------------------------------

TEST(Checkpoints, CompleteOnlyOnceCommittedAndPrunedToKeepLast) {
  const std::string root = scratch("ckpt");
  zero::RunCheckpoints m(root, 2);
  zero::RunState st;
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
  zero::RunCheckpoints m(root, 3);
  zero::RunState st;
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
  zero::RunCheckpoints m(root, 2);
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
  const zero::RunState s = zero::RunState::from_json(v1, "c.json");
  EXPECT_EQ(s.step, 4);
  EXPECT_TRUE(s.outstanding.empty());
  EXPECT_EQ(s.next_ordinal, 0);
  EXPECT_THROW(zero::RunState::from_json("{\"format\":\"other\"}", "c.json"), IoError);
  EXPECT_THROW(zero::RunState::from_json("{\"format\":\"tiller-controller-2\",\"step\":1}", "c.json"), IoError);
  EXPECT_THROW(zero::RunState::from_json("not json", "c.json"), IoError);
}

// --- the supervisor (tiller launch) -----------------------------------------------------------

TEST(Supervisor, DiagnosisTellsCurableFromConfigErrors) {
  EXPECT_EQ(job::diagnose({0, 0, {}}).verdict, job::Verdict::kDone);
  // A rank that died: the first error line is the cause, and a restart may cure it.
  const job::Diagnosis died = job::diagnose({137, 0, {"[12:00] [info] step 3/8", "tiller: error: rank 2: engine 0 (host:1) "
                                           "stream ended", "tiller: error: rank 0: later noise"}});
  EXPECT_EQ(died.verdict, job::Verdict::kRestart);
  EXPECT_EQ(died.cause, "tiller: error: rank 2: engine 0 (host:1) stream ended (exit code 137)");
  const job::Diagnosis killed = job::diagnose({1, 0, {"mpirun noticed that process rank 3 with PID 7 on node n exited on signal 9 "
                                            "(Killed)."}});
  EXPECT_EQ(killed.verdict, job::Verdict::kRestart);
  EXPECT_NE(killed.cause.find("exited on signal 9"), std::string::npos);
  // Exit code 2 is a config or usage error, from any rank: never retried.
  EXPECT_EQ(job::diagnose({2, 0, {"tiller: error: rank 0: data/p: is a directory"}}).verdict, job::Verdict::kGiveUp);
  EXPECT_EQ(job::diagnose({1, 0, {"There are not enough slots available in the system"}}).verdict, job::Verdict::kGiveUp);
  EXPECT_EQ(job::diagnose({0, 9, {}}).verdict, job::Verdict::kRestart);
  EXPECT_DOUBLE_EQ(job::backoff_seconds(1, 10, 300), 10);
  EXPECT_DOUBLE_EQ(job::backoff_seconds(3, 10, 300), 40);
  EXPECT_DOUBLE_EQ(job::backoff_seconds(9, 10, 300), 300);
}

// Real processes (sh): a job that fails once is restarted with TILLER_RESTARTS=1 and finishes; an
// incomplete checkpoint a crash left is removed first; a config error (exit 2) is not retried; a
// job that keeps failing stops after max_restarts.
TEST(Supervisor, RestartsACurableFailureAndNothingElse) {
  const std::string d = scratch("supervisor");
  fs::create_directories(d + "/ckpt/step_000002");
  zero::RunState st;
  st.step = 2;
  write_file_atomic(d + "/ckpt/step_000002/controller.json", st.to_json());
  fs::create_directories(d + "/ckpt/step_000004/actor");  // cut short: no controller.json
  std::vector<std::string> lines;
  job::SupervisorOptions o;
  o.checkpoint_dir = d + "/ckpt";
  o.max_restarts = 2;
  o.backoff_first_s = 0.01;
  o.log = [&](const std::string& l) { lines.push_back(l); };
  o.command = {"sh", "-c", "echo run $TILLER_RESTARTS >> " + d + "/runs; if [ ! -e " + d +
                               "/failed ]; then touch " + d + "/failed; echo 'tiller: error: rank 1: boom'; exit 1; fi"};
  EXPECT_EQ(job::supervise(o), 0);
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
  EXPECT_EQ(job::supervise(o), 2);
  EXPECT_EQ(*read_file(d + "/config_runs"), "x\n");
  EXPECT_TRUE(logged("not restarting: a config or launch error"));

  lines.clear();
  o.command = {"sh", "-c", "echo x >> " + d + "/always; exit 3"};
  EXPECT_EQ(job::supervise(o), 3);
  EXPECT_EQ(*read_file(d + "/always"), "x\nx\nx\n");  // the run and its 2 restarts
  EXPECT_TRUE(logged("all 2 restart(s) are used: exit code 3"));
}

}  // namespace
}  // namespace tiller::controller
