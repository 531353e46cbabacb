#include <map>
#include <set>

#include <gtest/gtest.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::dist {
namespace {

struct Layout {
  int actor = 1, critic = 1, reward = 0;  // reward 0: disabled
  std::string ref_with = "actor";         // "" = own group of ref_gpus
  int ref_gpus = 1;
  std::string reward_with;                // colocation of the reward model
  int engines = 1, tp = 1;
};

JobConfig make_config(const Layout& l) {
  JobConfig c;
  c.roles.actor.gpus = l.actor;
  c.roles.critic.enabled = l.critic > 0;
  c.roles.critic.gpus = std::max(l.critic, 1);
  if (l.critic == 0) c.algo.advantage_estimator = "reinforce";
  c.roles.ref.colocate_with = l.ref_with;
  c.roles.ref.gpus = l.ref_gpus;
  c.roles.reward.enabled = l.reward > 0 || !l.reward_with.empty();
  c.roles.reward.gpus = std::max(l.reward, 1);
  c.roles.reward.colocate_with = l.reward_with;
  if (c.roles.reward.enabled) c.reward.type = RewardType::kModel;
  c.engines.count = l.engines;
  c.engines.tp = l.tp;
  c.validate();
  return c;
}

// What every plan must satisfy, whatever the layout.
void check_invariants(const RankPlan& plan, const JobConfig& c, const NodeMap& nodes) {
  ASSERT_EQ(plan.world_size, nodes.world_size());
  ASSERT_EQ(static_cast<int>(plan.ranks.size()), plan.world_size);
  EXPECT_EQ(plan.controller, 0);
  EXPECT_EQ(plan.ranks[0].roles, std::vector<std::string>{"controller"});
  EXPECT_EQ(plan.ranks[0].gpu, -1);
  // Each worker rank: a distinct GPU of its node, and at least one role.
  std::map<int, std::set<int>> gpus_used;
  for (const auto& a : plan.ranks) {
    EXPECT_EQ(a.rank, &a - plan.ranks.data());
    if (a.rank == plan.controller) continue;
    EXPECT_FALSE(a.roles.empty()) << "rank " << a.rank << " has no role";
    const auto& node = nodes.nodes[a.node];
    EXPECT_NE(std::find(node.ranks.begin(), node.ranks.end(), a.rank), node.ranks.end());
    if (node.gpus >= 0) {
      EXPECT_GE(a.gpu, 0);
      EXPECT_LT(a.gpu, node.gpus);
      EXPECT_TRUE(gpus_used[a.node].insert(a.gpu).second) << "GPU " << a.gpu << " of node " << a.node << " twice";
    }
    // Engines never share a rank with trainer roles, unless hybrid (then always with the actor).
    if (a.engine >= 0 && !plan.hybrid) EXPECT_EQ(a.roles.size(), 1u);
    if (a.engine >= 0 && plan.hybrid) EXPECT_TRUE(a.trainer_roles.has(Role::kActor));
  }
  // Engines: the configured count, TP ranks on one node, consecutive GPUs.
  ASSERT_EQ(static_cast<int>(plan.engines.size()), c.engine_count());
  for (const auto& e : plan.engines) {
    ASSERT_EQ(static_cast<int>(e.ranks.size()), c.engines.tp);
    for (std::size_t i = 0; i < e.ranks.size(); ++i) {
      const auto& a = plan.ranks[e.ranks[i]];
      EXPECT_EQ(a.node, e.node) << "engine " << e.index << " crosses nodes";
      EXPECT_EQ(a.engine, e.index);
      EXPECT_EQ(a.engine_tp_rank, static_cast<int>(i));
      if (a.gpu >= 0 && i > 0) EXPECT_EQ(a.gpu, plan.ranks[e.ranks[i - 1]].gpu + 1);
    }
  }
  // Trainer groups: sizes as configured; colocated groups equal their host's.
  for (const auto* name : {"actor", "critic", "ref", "reward"}) {
    const RoleConfig& r = std::string(name) == "actor"    ? c.roles.actor
                          : std::string(name) == "critic" ? c.roles.critic
                          : std::string(name) == "ref"    ? c.roles.ref
                                                          : c.roles.reward;
    const RoleGroup* g = plan.group(name);
    if (!r.enabled) {
      EXPECT_EQ(g, nullptr) << name;
      continue;
    }
    ASSERT_NE(g, nullptr) << name;
    if (r.colocate_with.empty()) {
      EXPECT_EQ(static_cast<int>(g->ranks.size()), r.gpus) << name;
    } else {
      EXPECT_EQ(g->ranks, plan.group(r.colocate_with)->ranks) << name;
      EXPECT_EQ(g->colocated_with, r.colocate_with);
    }
    for (int rank : g->ranks) {
      const auto& roles = plan.ranks[rank].roles;
      EXPECT_NE(std::find(roles.begin(), roles.end(), name), roles.end());
    }
  }
}

RankPlan plan_on(const JobConfig& c, const std::vector<int>& gpus) {
  NodeMap nodes = NodeMap::fill_by_slot(gpus, required_world_size(c));
  RankPlan plan = make_rank_plan(c, nodes);
  check_invariants(plan, c, nodes);
  return plan;
}

std::string plan_error(const JobConfig& c, const std::vector<int>& gpus) {
  try {
    plan_on(c, gpus);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(RankPlan, SingleNodeSmall) {
  auto c = make_config({.actor = 2, .critic = 1, .engines = 1, .tp = 1});
  auto plan = plan_on(c, {4});
  EXPECT_EQ(plan.world_size, 5);
  EXPECT_EQ(plan.group("actor")->ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(plan.group("critic")->ranks, (std::vector<int>{3}));
  EXPECT_EQ(plan.group("ref")->ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(plan.engines[0].ranks, (std::vector<int>{4}));
  EXPECT_EQ(plan.ranks[1].label(), "actor+ref");
  EXPECT_EQ(plan.ranks[4].label(), "engine0.tp0");
  EXPECT_EQ(plan.ranks[4].gpu, 3);
}

TEST(RankPlan, EnginesGoToLaterNodesAndStayInside) {
  // 2 x 8 GPUs: 4 actor + 2 critic + 2 reward, 4 engines x TP 2 fill node 1.
  auto c = make_config({.actor = 4, .critic = 2, .reward = 2, .engines = 4, .tp = 2});
  auto plan = plan_on(c, {8, 8});
  for (const auto& e : plan.engines) EXPECT_EQ(e.node, 1);
  // Engine indices rise with the GPU index.
  EXPECT_EQ(plan.engines[0].ranks, (std::vector<int>{9, 10}));
  EXPECT_EQ(plan.engines[3].ranks, (std::vector<int>{15, 16}));
  EXPECT_EQ(plan.ranks[9].gpu, 0);
  EXPECT_EQ(plan.group("actor")->ranks, (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(plan.group("reward")->ranks, (std::vector<int>{7, 8}));
}

TEST(RankPlan, TpGroupsNeverCrossNodesEvenWhenRanksWouldFit) {
  // 3 nodes x 4 GPUs, engines TP 4: each must take a whole node; trainers spill over nodes.
  auto c = make_config({.actor = 3, .critic = 1, .engines = 2, .tp = 4});
  auto plan = plan_on(c, {4, 4, 4});
  EXPECT_EQ(plan.engines[0].node, 1);
  EXPECT_EQ(plan.engines[1].node, 2);
  EXPECT_EQ(plan.group("actor")->ranks, (std::vector<int>{1, 2, 3}));
}

TEST(RankPlan, ColocationModes) {
  // Own ref group.
  auto own = make_config({.actor = 2, .critic = 2, .ref_with = "", .ref_gpus = 2, .engines = 2, .tp = 1});
  auto p1 = plan_on(own, {8});
  EXPECT_TRUE(p1.group("ref")->colocated_with.empty());
  EXPECT_EQ(p1.group("ref")->ranks.size(), 2u);
  // Reward with critic.
  auto rc = make_config({.actor = 2, .critic = 2, .reward_with = "critic", .engines = 2, .tp = 1});
  auto p2 = plan_on(rc, {6});
  EXPECT_EQ(p2.group("reward")->ranks, p2.group("critic")->ranks);
  EXPECT_EQ(p2.ranks[p2.group("critic")->ranks[0]].label(), "critic+reward");
  // Everything on the actor (critic-free GRPO with a reward model).
  auto all = make_config({.actor = 4, .critic = 0, .reward_with = "actor", .engines = 1, .tp = 4});
  auto p3 = plan_on(all, {8});
  EXPECT_EQ(p3.ranks[1].label(), "actor+ref+reward");
  EXPECT_EQ(p3.group("critic"), nullptr);
}

TEST(RankPlan, UnevenNodes) {
  auto c = make_config({.actor = 4, .critic = 2, .engines = 3, .tp = 2});
  // 13 ranks fill node 0 (controller + 8), node 1 (2) and half of node 2 (2 of 4 slots).
  auto plan = plan_on(c, {8, 2, 4});
  // Best fit, later nodes first: the two small nodes take an engine each, node 0 the third.
  std::multiset<int> engine_nodes;
  for (const auto& e : plan.engines) engine_nodes.insert(e.node);
  EXPECT_EQ(engine_nodes, (std::multiset<int>{0, 1, 2}));
  EXPECT_EQ(plan.group("actor")->ranks, (std::vector<int>{1, 2, 3, 4}));
}

TEST(RankPlan, CpuRunHasNoGpuIndices) {
  auto c = make_config({.actor = 2, .critic = 1, .engines = 1, .tp = 1});
  NodeMap nodes;
  nodes.nodes.push_back({"host", {0, 1, 2, 3, 4}, -1});
  auto plan = make_rank_plan(c, nodes);
  check_invariants(plan, c, nodes);
  for (const auto& a : plan.ranks) EXPECT_EQ(a.gpu, -1);
}

TEST(RankPlan, ManyLayouts) {
  // 1 to 64 nodes, 1 to 8 GPUs per node, TP 1 to 8: half the GPUs to engines, the rest to
  // actor/critic (and ref in its own group when there is room). Every plan must satisfy the
  // invariants; a TP larger than a node must fail with a clear message.
  int planned = 0, refused = 0;
  for (int nodes : {1, 2, 3, 4, 8, 16, 32, 64}) {
    for (int g : {1, 2, 4, 8}) {
      for (int tp : {1, 2, 4, 8}) {
        const int total = nodes * g;
        const int engine_gpus = total / 2 / tp * tp;
        const int engines = engine_gpus / tp;
        const int rest = total - engine_gpus;
        if (rest < 1 || engines < 1) continue;
        Layout l{.actor = std::max(1, rest / 2), .critic = 0, .engines = engines, .tp = tp};
        if (rest - l.actor >= 1) l.critic = rest - l.actor;
        if (l.critic >= 2) {  // give ref its own group
          l.ref_with = "";
          l.ref_gpus = l.critic / 2;
          l.critic -= l.ref_gpus;
        }
        auto c = make_config(l);
        std::vector<int> gpus(nodes, g);
        if (tp > g) {
          EXPECT_NE(plan_error(c, gpus).find("need " + std::to_string(tp) + " GPUs on one node"), std::string::npos);
          ++refused;
        } else {
          std::string err = plan_error(c, gpus);
          EXPECT_EQ(err, "") << nodes << " nodes x " << g << " GPUs, TP " << tp;
          ++planned;
        }
      }
    }
  }
  EXPECT_GT(planned, 50);
  EXPECT_GT(refused, 10);
}

TEST(RankPlan, ImpossibleRequestsSayWhatToChange) {
  // The example: 2 engines x TP 4 on nodes with 2 GPUs.
  auto c = make_config({.actor = 2, .critic = 1, .engines = 2, .tp = 4});
  auto msg = plan_error(c, {2, 2, 2, 2, 2, 2});
  EXPECT_NE(msg.find("2 engines x TP 4 need 4 GPUs on one node"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at most 2 free"), std::string::npos) << msg;
  EXPECT_NE(msg.find("use engines.tp <= 2"), std::string::npos) << msg;
  // Fragmentation: enough GPUs in all, but not 4 on one node after the first engine.
  auto frag = make_config({.actor = 1, .critic = 1, .engines = 2, .tp = 4});
  msg = plan_error(frag, {3, 3, 4});
  EXPECT_NE(msg.find("after placing 1"), std::string::npos) << msg;
  // Too few slots.
  auto big = make_config({.actor = 16, .critic = 8, .engines = 4, .tp = 2});
  msg = plan_error(big, {8, 8});
  EXPECT_NE(msg.find("needs 33 ranks but 2 node(s) with 16 GPUs"), std::string::npos) << msg;
}

// cluster.hybrid: one engine per engines.tp actor ranks, inside them; no engine ranks of its own.
TEST(RankPlan, SequenceGroupsComeFromTheRoleOrItsHost) {
  JobConfig c = make_config({.actor = 4, .critic = 2, .engines = 1, .tp = 1});
  c.roles.actor.sequence_parallel = 4;
  c.roles.critic.sequence_parallel = 2;
  c.validate();
  const RankPlan plan = plan_on(c, {8});
  EXPECT_EQ(plan.group(Role::kActor)->sequence_parallel, 4);
  EXPECT_EQ(plan.group(Role::kRef)->sequence_parallel, 4);  // colocated with the actor: its slices
  EXPECT_EQ(plan.group(Role::kCritic)->sequence_parallel, 2);
  EXPECT_NE(plan.table().find("sequence parallel 4 (1 groups of consecutive ranks)"), std::string::npos) << plan.table();
}

TEST(RankPlan, HybridPutsAnEngineOnEveryActorGpu) {
  JobConfig c = make_config({.actor = 4, .critic = 0, .engines = 1, .tp = 2});
  c.cluster.hybrid = true;
  c.validate();
  EXPECT_EQ(c.engine_count(), 2);
  EXPECT_EQ(required_world_size(c), 5);
  EXPECT_NE(world_size_breakdown(c).find("2 engines of TP 2 inside the actor's ranks"), std::string::npos)
      << world_size_breakdown(c);
  const RankPlan plan = plan_on(c, {4});
  EXPECT_TRUE(plan.hybrid);
  ASSERT_EQ(plan.engines.size(), 2u);
  EXPECT_EQ(plan.engines[0].ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(plan.engines[1].ranks, (std::vector<int>{3, 4}));
  EXPECT_EQ(plan.ranks[3].label(), "actor+ref+engine1.tp0");
  EXPECT_NE(plan.table().find("inside the actor's processes (hybrid)"), std::string::npos);
  // 8 GPUs, TP 1, a critic colocated with the actor: 8 engines, 9 ranks.
  JobConfig big = make_config({.actor = 8, .critic = 1, .engines = 1, .tp = 1});
  big.roles.critic.colocate_with = "actor";
  big.cluster.hybrid = true;
  big.validate();
  const RankPlan p8 = plan_on(big, {8});
  EXPECT_EQ(p8.engines.size(), 8u);
  EXPECT_EQ(p8.ranks[8].label(), "actor+critic+ref+engine7.tp0");
  // A TP group may not straddle nodes: 3 + 3 GPUs, TP 2 over 6 actor ranks would put engine 1 on both.
  JobConfig split = make_config({.actor = 6, .critic = 0, .engines = 1, .tp = 2});
  split.cluster.hybrid = true;
  const std::string msg = plan_error(split, {3, 3});
  EXPECT_NE(msg.find("cluster.hybrid: engine 1 would span node 0"), std::string::npos) << msg;
}

// Hybrid TP engines over NCCL score after their generation (auto); overlapping the two there is
// refused, naming the key. TP 1 engines and the CPU's MPI keep the overlap.
TEST(RankPlan, HybridTensorParallelEnginesScoreAfterGeneratingOverNccl) {
  JobConfig c = make_config({.actor = 2, .critic = 0, .engines = 1, .tp = 2});
  c.cluster.hybrid = true;
  c.validate();
  EXPECT_TRUE(c.hybrid_scores_after_generate(BackendKind::kNccl));
  EXPECT_FALSE(c.hybrid_scores_after_generate(BackendKind::kMpi));  // the CPU tests' layout
  EXPECT_NO_THROW(check_layout_on_backend(c, BackendKind::kNccl));
  EXPECT_NO_THROW(check_layout_on_backend(c, BackendKind::kMpi));
  c.cluster.hybrid_scoring = HybridScoring::kOverlap;
  EXPECT_FALSE(c.hybrid_scores_after_generate(BackendKind::kNccl));
  EXPECT_NO_THROW(check_layout_on_backend(c, BackendKind::kMpi));
  try {
    check_layout_on_backend(c, BackendKind::kNccl);
    FAIL() << "a hybrid TP-2 engine scoring beside its generation over NCCL was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cluster.hybrid_scoring = overlap with engines.tp = 2 over NCCL"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("use cluster.hybrid_scoring=auto"), std::string::npos) << e.what();
  }
  c.engines.tp = 1;  // an engine per GPU: no all-reduce of its own
  EXPECT_NO_THROW(check_layout_on_backend(c, BackendKind::kNccl));
  c.cluster.hybrid_scoring = HybridScoring::kAuto;
  EXPECT_FALSE(c.hybrid_scores_after_generate(BackendKind::kNccl));
  c.cluster.hybrid_scoring = HybridScoring::kAfterGenerate;
  EXPECT_TRUE(c.hybrid_scores_after_generate(BackendKind::kMpi));
  c.engines.tp = 2;
  c.cluster.hybrid = false;  // separate pools at TP 2: the key belongs to hybrid jobs
  EXPECT_THROW(c.validate(), ConfigError);
  c.cluster.hybrid_scoring = HybridScoring::kAuto;
  EXPECT_FALSE(c.hybrid_scores_after_generate(BackendKind::kNccl));
  EXPECT_NO_THROW(check_layout_on_backend(c, BackendKind::kNccl));
}

TEST(RankPlan, WorldSizeMismatchAndOverfullNode) {
  auto c = make_config({.actor = 2, .critic = 1, .engines = 1, .tp = 1});
  NodeMap small;
  small.nodes.push_back({"a", {0, 1, 2}, 8});
  try {
    make_rank_plan(c, small);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("needs 5 ranks (1 controller + 2 actor + 1 critic + ref (colocated with actor) "
                                         "+ 1 engine (1 x TP 1)) but 3 were launched; launch with mpirun -np 5"),
              std::string::npos)
        << e.what();
  }
  NodeMap overfull;
  overfull.nodes.push_back({"a", {0, 1, 2, 3, 4}, 2});
  try {
    make_rank_plan(c, overfull);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("node 0 (a) runs 4 worker ranks but has 2 GPUs"), std::string::npos)
        << e.what();
  }
}

TEST(RankPlan, PlanIsDeterministic) {
  auto c = make_config({.actor = 8, .critic = 4, .reward = 2, .engines = 5, .tp = 2});
  EXPECT_EQ(plan_on(c, {8, 8, 8}).table(), plan_on(c, {8, 8, 8}).table());
}

TEST(RankPlan, LocalPosition) {
  NodeMap nodes = NodeMap::fill_by_slot({2, 2}, 5);  // node 0: ranks 0-2, node 1: ranks 3-4
  EXPECT_EQ(nodes.local_position(2).index, 2);
  EXPECT_EQ(nodes.local_position(2).ranks_on_node, 3);
  EXPECT_EQ(nodes.local_position(4).index, 1);
  EXPECT_EQ(nodes.local_position(4).ranks_on_node, 2);
  EXPECT_THROW(nodes.local_position(5), Error);
}

TEST(RankPlan, SharedGpus) {
  // One GPU: the actor (with the reference) and one engine share GPU 0.
  JobConfig one = make_config({.actor = 1, .critic = 0});
  EXPECT_NE(plan_error(one, {1}), "");  // without sharing: 2 worker ranks, 1 GPU
  one.cluster.ranks_per_gpu = 2;
  NodeMap nodes = NodeMap::fill_by_slot({1}, required_world_size(one), 2);
  RankPlan plan = make_rank_plan(one, nodes);
  ASSERT_EQ(plan.world_size, 3);
  EXPECT_EQ(plan.ranks[1].roles, (std::vector<std::string>{"actor", "ref"}));
  EXPECT_EQ(plan.ranks[2].roles, std::vector<std::string>{"engine"});
  EXPECT_EQ(plan.ranks[1].gpu, 0);
  EXPECT_EQ(plan.ranks[2].gpu, 0);
  // Two GPUs, two per GPU: the actor over both GPUs, and a TP 2 engine over the same two.
  JobConfig two = make_config({.actor = 2, .critic = 0, .engines = 1, .tp = 2});
  two.cluster.ranks_per_gpu = 2;
  plan = make_rank_plan(two, NodeMap::fill_by_slot({2}, required_world_size(two), 2));
  EXPECT_EQ(plan.group("actor")->ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(plan.engines[0].ranks, (std::vector<int>{3, 4}));
  EXPECT_EQ(std::vector<int>({plan.ranks[1].gpu, plan.ranks[2].gpu, plan.ranks[3].gpu, plan.ranks[4].gpu}),
            (std::vector<int>{0, 1, 0, 1}));
  // The launch line gives each node two slots per GPU.
  EXPECT_EQ(mpirun_command({1, 1}, 5, 2, "c.yaml", {}).hostfile, "node0 slots=3\nnode1 slots=2\n");
}

TEST(RankPlan, MpirunCommand) {
  auto launch = mpirun_command({8, 8}, 17, 1, "configs/x.yaml", {"rollout.batch_size=512"});
  EXPECT_EQ(launch.hostfile, "node0 slots=9\nnode1 slots=8\n");
  EXPECT_EQ(launch.command,
            "mpirun -np 17 --hostfile hosts --map-by slot --bind-to none -x NCCL_NVLS_ENABLE=0 "
            "-x TORCH_SYMM_MEM_DISABLE_MULTICAST=1 -x NVSHMEM_DISABLE_NVLS=1 tiller train -c configs/x.yaml "
            "--set rollout.batch_size=512");
  auto one = mpirun_command({4}, 5, 1, "q.yaml", {});
  EXPECT_EQ(one.hostfile, "");
  EXPECT_EQ(one.command.rfind("mpirun -np 5 --bind-to none", 0), 0u);
  // On CPU: more ranks than cores may run, and no NCCL variables.
  EXPECT_EQ(mpirun_command({4}, 4, 1, "q.yaml", {}, /*cpu=*/true).command,
            "mpirun -np 4 --oversubscribe --bind-to none tiller train -c q.yaml");
}

}  // namespace
}  // namespace tiller::dist
