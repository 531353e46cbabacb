#include "tiller/dist/rank_plan.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::dist {
namespace {

struct RoleRef {
  Role role;
  std::string name;
  const RoleConfig* cfg;
};

// The trainer roles in the canonical order.
std::vector<RoleRef> trainer_roles(const JobConfig& c) {
  const RoleConfig* cfgs[kRoleCount] = {&c.roles.actor, &c.roles.critic, &c.roles.ref, &c.roles.reward};
  std::vector<RoleRef> out;
  for (Role r : kRoles) out.push_back({r, std::string(role_name(r)), cfgs[role_index(r)]});
  return out;
}

std::string join_ints(const std::vector<int>& v) {
  // Ranges compress: 1,2,3,4,7 -> "1-4,7"
  std::string out;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j > i ? fmt::format("{}-{}", v[i], v[j]) : std::to_string(v[i]);
    i = j + 1;
  }
  return out;
}

std::string node_name(const NodeMap& nodes, int n) {
  const auto& host = nodes.nodes[n].host;
  return host.empty() ? fmt::format("node {}", n) : fmt::format("node {} ({})", n, host);
}

// cluster.hybrid: engine e is actor group ranks [e * tp, (e + 1) * tp), in those ranks' processes;
// a TP group must not straddle nodes.
void place_hybrid_engines(RankPlan& plan, const NodeMap& nodes, int tp) {
  const RoleGroup* actor = plan.group(Role::kActor);
  TILLER_CHECK(actor != nullptr, "rank plan: hybrid without an actor group");
  const int count = static_cast<int>(actor->ranks.size()) / tp;
  for (int e = 0; e < count; ++e) {
    EngineGroup group;
    group.index = e;
    group.ranks.assign(actor->ranks.begin() + e * tp, actor->ranks.begin() + (e + 1) * tp);
    group.node = plan.ranks[group.ranks.front()].node;
    for (int i = 0; i < tp; ++i) {
      auto& a = plan.ranks[group.ranks[i]];
      if (a.node != group.node)
        throw ConfigError(fmt::format(
            "cluster.hybrid: engine {} would span {} and {} (actor ranks {}-{}); an engine's TP group must sit on one "
            "node: make engines.tp divide the GPUs per node, or give the actor whole nodes",
            e, node_name(nodes, group.node), node_name(nodes, a.node), group.ranks.front(), group.ranks.back()));
      a.roles.push_back("engine");
      a.engine = e;
      a.engine_tp_rank = i;
    }
    plan.engines.push_back(std::move(group));
  }
}

}  // namespace

int NodeMap::world_size() const {
  int n = 0;
  for (const auto& node : nodes) n += static_cast<int>(node.ranks.size());
  return n;
}

NodeMap::LocalPosition NodeMap::local_position(int rank) const {
  for (const auto& node : nodes) {
    for (std::size_t i = 0; i < node.ranks.size(); ++i) {
      if (node.ranks[i] == rank) return {static_cast<int>(i), static_cast<int>(node.ranks.size())};
    }
  }
  TILLER_CHECK(false, "node map: rank {} is on no node", rank);
  return {};
}

NodeMap NodeMap::fill_by_slot(const std::vector<int>& gpus_per_node, int world_size, int ranks_per_gpu) {
  if (gpus_per_node.empty()) throw ConfigError("the node list is empty; give at least one node");
  TILLER_CHECK(ranks_per_gpu >= 1, "ranks_per_gpu must be >= 1");
  int slots = 1;
  for (int g : gpus_per_node) {
    if (g < 1) throw ConfigError(fmt::format("every node needs at least one GPU (got {})", g));
    slots += g * ranks_per_gpu;
  }
  if (world_size > slots) {
    throw ConfigError(fmt::format("the config needs {} ranks but {} node(s) with {} GPUs in all offer {} slots "
                                  "({} per GPU + one for the controller); add nodes, use fewer GPUs per role, or "
                                  "share GPUs (cluster.ranks_per_gpu)",
                                  world_size, gpus_per_node.size(), (slots - 1) / ranks_per_gpu, slots, ranks_per_gpu));
  }
  NodeMap map;
  int rank = 0;
  for (std::size_t n = 0; n < gpus_per_node.size(); ++n) {
    Node node;
    node.host = fmt::format("node{}", n);
    node.gpus = gpus_per_node[n];
    const int node_slots = gpus_per_node[n] * ranks_per_gpu + (n == 0 ? 1 : 0);
    for (int s = 0; s < node_slots && rank < world_size; ++s) node.ranks.push_back(rank++);
    map.nodes.push_back(std::move(node));
  }
  return map;
}

std::string RankAssignment::label() const {
  std::string out;
  for (const auto& r : roles) {
    if (!out.empty()) out += "+";
    out += r == "engine" ? fmt::format("engine{}.tp{}", engine, engine_tp_rank) : r;
  }
  return out.empty() ? "idle" : out;
}

const RoleGroup* RankPlan::group(Role role) const {
  for (const auto& g : groups) {
    if (g.role == role) return &g;
  }
  return nullptr;
}

const RoleGroup* RankPlan::group(std::string_view role) const {
  const std::optional<Role> r = parse_role(role);
  return r ? group(*r) : nullptr;
}

std::string RankPlan::table() const {
  std::string out = fmt::format("{:>5}  {:>4}  {:>3}  {}\n", "rank", "node", "gpu", "role");
  for (const auto& a : ranks) {
    out += fmt::format("{:>5}  {:>4}  {:>3}  {}\n", a.rank, a.node, a.gpu < 0 ? std::string("-") : std::to_string(a.gpu),
                       a.label());
  }
  out += "\ngroups:\n";
  out += fmt::format("  controller  rank {}\n", controller);
  for (const auto& g : groups) {
    out += fmt::format("  {:<10}  ranks {} ({} rank{}){}{}\n", role_name(g.role), join_ints(g.ranks), g.ranks.size(),
                       g.ranks.size() == 1 ? "" : "s",
                       g.colocated_with.empty() ? std::string() : fmt::format(", colocated with {}", g.colocated_with),
                       g.sequence_parallel > 1
                           ? fmt::format(", sequence parallel {} ({} groups of consecutive ranks)", g.sequence_parallel,
                                         g.ranks.size() / static_cast<size_t>(g.sequence_parallel))
                           : std::string());
  }
  for (const auto& e : engines) {
    out += fmt::format("  engine {:<3}  ranks {} on node {} (TP {}){}\n", e.index, join_ints(e.ranks), e.node,
                       e.ranks.size(), hybrid ? ", inside the actor's processes (hybrid)" : "");
  }
  return out;
}

int required_world_size(const JobConfig& config) {
  // Hybrid engines live in the actor ranks' processes: they add no rank.
  long long n = 1 + (config.cluster.hybrid ? 0 : config.engines.count * config.engines.tp);
  for (const auto& r : trainer_roles(config)) {
    if (r.cfg->enabled && r.cfg->colocate_with.empty()) n += r.cfg->gpus;
  }
  if (n > (1LL << 30)) throw ConfigError(fmt::format("the config asks for {} ranks; that is not a cluster", n));
  return static_cast<int>(n);
}

std::string world_size_breakdown(const JobConfig& config) {
  std::string out = "1 controller";
  for (const auto& r : trainer_roles(config)) {
    if (!r.cfg->enabled) continue;
    if (r.cfg->colocate_with.empty()) {
      out += fmt::format(" + {} {}", r.cfg->gpus, r.name);
    } else {
      out += fmt::format(" + {} (colocated with {})", r.name, r.cfg->colocate_with);
    }
  }
  if (config.cluster.hybrid) {
    out += fmt::format(" (+ {} engine{} of TP {} inside the actor's ranks: cluster.hybrid)", config.engine_count(),
                       config.engine_count() == 1 ? "" : "s", config.engines.tp);
  } else if (config.engines.count > 0) {
    out += fmt::format(" + {} engine ({} x TP {})", config.engines.count * config.engines.tp, config.engines.count,
                       config.engines.tp);
  }
  return out;
}

RankPlan make_rank_plan(const JobConfig& config, const NodeMap& nodes) {
  config.validate();
  const int world = nodes.world_size();
  const int needed = required_world_size(config);
  if (world != needed) {
    throw ConfigError(fmt::format("the config needs {} ranks ({}) but {} were launched; launch with mpirun -np {} "
                                  "(tiller plan prints the full command) or change roles.*.gpus / engines.*",
                                  needed, world_size_breakdown(config), world, needed));
  }
  RankPlan plan;
  plan.world_size = world;
  plan.controller = 0;
  plan.ranks.resize(world);

  // Every rank's node, and the worker (non-controller) ranks of each node in rank order.
  std::vector<std::vector<int>> workers(nodes.nodes.size());
  std::vector<int> seen(world, 0);
  for (std::size_t n = 0; n < nodes.nodes.size(); ++n) {
    const auto& node = nodes.nodes[n];
    for (int r : node.ranks) {
      TILLER_CHECK(r >= 0 && r < world && !seen[r], "node map: rank {} is missing, repeated or out of range", r);
      seen[r] = 1;
      plan.ranks[r].rank = r;
      plan.ranks[r].node = static_cast<int>(n);
      if (r != plan.controller) workers[n].push_back(r);
    }
    std::sort(workers[n].begin(), workers[n].end());
    const int per_gpu = static_cast<int>(config.cluster.ranks_per_gpu);
    if (node.gpus >= 0 && static_cast<int>(workers[n].size()) > node.gpus * per_gpu) {
      throw ConfigError(fmt::format("{} runs {} worker ranks but has {} GPUs (cluster.ranks_per_gpu = {}); put at "
                                    "most {} ranks (+1 for the controller on the first node) in its hostfile slots",
                                    node_name(nodes, static_cast<int>(n)), workers[n].size(), node.gpus, per_gpu,
                                    node.gpus * per_gpu));
    }
  }
  plan.ranks[plan.controller].roles = {"controller"};
  // GPU index: position among the node's worker ranks (the controller holds none), modulo the
  // node's GPUs when they are shared (cluster.ranks_per_gpu): with 2 per GPU, the engines (which
  // take the last ranks) land on the same GPUs as the first trainer ranks.
  for (std::size_t n = 0; n < nodes.nodes.size(); ++n) {
    const int gpus = nodes.nodes[n].gpus;
    for (std::size_t i = 0; i < workers[n].size(); ++i) {
      plan.ranks[workers[n][i]].gpu = gpus > 0 ? static_cast<int>(i) % gpus : -1;
    }
  }

  // Engines first, best fit: the node with the fewest free ranks that still holds a TP group,
  // later nodes on ties (the controller's node is first and keeps the trainers). Each engine
  // takes the node's last free ranks, which are consecutive GPUs.
  std::vector<std::vector<int>> free_ranks = workers;
  const int tp = static_cast<int>(config.engines.tp);
  const int separate_engines = config.cluster.hybrid ? 0 : static_cast<int>(config.engines.count);
  for (int e = 0; e < separate_engines; ++e) {
    int best = -1;
    for (int n = static_cast<int>(free_ranks.size()) - 1; n >= 0; --n) {
      const int f = static_cast<int>(free_ranks[n].size());
      if (f >= tp && (best < 0 || f < static_cast<int>(free_ranks[best].size()))) best = n;
    }
    if (best < 0) {
      std::string free_list;
      int most = 0;
      for (std::size_t n = 0; n < free_ranks.size(); ++n) {
        free_list += fmt::format("{}node {}: {}", free_list.empty() ? "" : ", ", n, free_ranks[n].size());
        most = std::max(most, static_cast<int>(free_ranks[n].size()));
      }
      throw ConfigError(fmt::format(
          "{} engines x TP {} need {} GPUs on one node for each engine; after placing {}, the nodes have at most {} "
          "free ({}); use engines.tp <= {}, fewer engines, or nodes with more GPUs",
          config.engines.count, tp, tp, e, most, free_list, std::max(most, 1)));
    }
    EngineGroup group;
    group.index = e;
    group.node = best;
    auto& f = free_ranks[best];
    group.ranks.assign(f.end() - tp, f.end());
    f.erase(f.end() - tp, f.end());
    plan.engines.push_back(std::move(group));
  }
  // Engines were numbered in placement order; renumber so that engine indices rise with node
  // and GPU index (engine 0 on the first GPUs of its node), which is how users read the table.
  std::vector<std::vector<int>> blocks;
  for (const auto& g : plan.engines) blocks.push_back(g.ranks);
  std::sort(blocks.begin(), blocks.end(), [&](const std::vector<int>& a, const std::vector<int>& b) {
    return std::make_pair(plan.ranks[a[0]].node, a[0]) < std::make_pair(plan.ranks[b[0]].node, b[0]);
  });
  for (std::size_t e = 0; e < blocks.size(); ++e) {
    auto& group = plan.engines[e];
    group.ranks = blocks[e];
    group.node = plan.ranks[blocks[e][0]].node;
    for (int i = 0; i < tp; ++i) {
      auto& a = plan.ranks[group.ranks[i]];
      a.roles.push_back("engine");
      a.engine = static_cast<int>(e);
      a.engine_tp_rank = i;
    }
  }

  // Trainer roles take what is left, in rank order.
  std::vector<int> left;
  for (const auto& f : free_ranks) left.insert(left.end(), f.begin(), f.end());
  std::sort(left.begin(), left.end());
  std::size_t next = 0;
  for (const auto& r : trainer_roles(config)) {
    if (!r.cfg->enabled || !r.cfg->colocate_with.empty()) continue;
    RoleGroup g;
    g.role = r.role;
    g.ranks.assign(left.begin() + next, left.begin() + next + r.cfg->gpus);
    next += r.cfg->gpus;
    g.sequence_parallel = static_cast<int>(r.cfg->sequence_parallel);
    for (int rank : g.ranks) plan.ranks[rank].trainer_roles.add(r.role);
    plan.groups.push_back(std::move(g));
  }
  TILLER_CHECK(next == left.size(), "rank plan: {} ranks left unassigned", left.size() - next);
  for (const auto& r : trainer_roles(config)) {
    if (!r.cfg->enabled || r.cfg->colocate_with.empty()) continue;
    const RoleGroup* host = plan.group(r.cfg->colocate_with);
    TILLER_CHECK(host != nullptr, "rank plan: {} colocated with missing role {}", r.name, r.cfg->colocate_with);
    RoleGroup g{r.role, host->ranks, r.cfg->colocate_with, host->sequence_parallel};
    for (int rank : g.ranks) plan.ranks[rank].trainer_roles.add(r.role);
    plan.groups.push_back(std::move(g));
  }
  // Groups, and each rank's role names, in the canonical order whatever the colocation.
  std::stable_sort(plan.groups.begin(), plan.groups.end(),
                   [](const RoleGroup& a, const RoleGroup& b) { return role_index(a.role) < role_index(b.role); });
  for (auto& a : plan.ranks)
    for (Role r : kRoles)
      if (a.trainer_roles.has(r)) a.roles.emplace_back(role_name(r));
  if (config.cluster.hybrid) place_hybrid_engines(plan, nodes, tp);
  plan.hybrid = config.cluster.hybrid;
  return plan;
}

LaunchCommand mpirun_command(const std::vector<int>& gpus_per_node, int world_size, int ranks_per_gpu,
                             const std::string& config_path,
                             const std::vector<std::string>& overrides, bool cpu) {
  LaunchCommand out;
  std::string cmd = fmt::format("mpirun -np {}", world_size);
  if (gpus_per_node.size() > 1) {
    for (std::size_t n = 0; n < gpus_per_node.size(); ++n) {
      out.hostfile += fmt::format("node{} slots={}\n", n, gpus_per_node[n] * ranks_per_gpu + (n == 0 ? 1 : 0));
    }
    cmd += " --hostfile hosts --map-by slot";
  }
  // Multicast off everywhere: NVLink SHARP can take shared GPUs down (see docs/gpu.md). On CPU,
  // ranks may outnumber the cores.
  cmd += cpu ? " --oversubscribe --bind-to none"
             : " --bind-to none -x NCCL_NVLS_ENABLE=0 -x TORCH_SYMM_MEM_DISABLE_MULTICAST=1 -x NVSHMEM_DISABLE_NVLS=1";
  cmd += fmt::format(" tiller train -c {}", config_path);
  for (const auto& o : overrides) cmd += fmt::format(" --set {}", o);
  out.command = cmd;
  return out;
}

DeviceChoice choose_device(const ClusterConfig& cluster, int gpus, bool have_nccl, int rank, const std::string& host) {
  DeviceKind kind = cluster.device;
  if (kind == DeviceKind::kAuto) kind = gpus > 0 && have_nccl ? DeviceKind::kCuda : DeviceKind::kCpu;
  if (kind == DeviceKind::kCuda && gpus == 0)
    throw ConfigError(fmt::format("cluster.device = cuda: rank {} ({}) sees no CUDA device; use cluster.device=cpu "
                                  "or the GPU build on a GPU node",
                                  rank, host));
  DeviceChoice c;
  c.cpu = kind == DeviceKind::kCpu;
  c.backend = cluster.backend == BackendKind::kAuto ? (c.cpu ? BackendKind::kMpi : BackendKind::kNccl) : cluster.backend;
  if (c.backend == BackendKind::kNccl && c.cpu) throw ConfigError("cluster.backend = nccl needs cluster.device = cuda");
  return c;
}

void check_layout_on_backend(const JobConfig& config, BackendKind backend) {
  // On 2xH100 (2026-11-27) a 32B hybrid job at TP 2 made no step while its trainers scored beside
  // its engines' generation (docs/training.md, the hybrid engine). $TILLER_ALLOW_HYBRID_TP_OVERLAP=1
  // lets it run anyway, to reproduce that stall (scripts/gpu/hybrid_stall.sh); nothing else.
  if (config.cluster.hybrid && config.engines.tp > 1 && backend == BackendKind::kNccl &&
      !config.hybrid_scores_after_generate(backend)) {
    const char* allow = std::getenv("TILLER_ALLOW_HYBRID_TP_OVERLAP");
    if (allow != nullptr && std::string_view(allow) == "1") return;
    throw ConfigError(fmt::format("cluster.hybrid_scoring = overlap with engines.tp = {} over NCCL: the engines' "
                                  "all-reduces and the trainers' collectives would share the GPUs at once and can "
                                  "deadlock there; use cluster.hybrid_scoring=auto (or after_generate)",
                                  config.engines.tp));
  }
}

}  // namespace tiller::dist
