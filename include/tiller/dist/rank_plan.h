// The rank plan: which world rank does what. A pure function of (config, node map): every rank
// computes the same plan from the same inputs, so no rank has to tell the others.
//
// Layout rules:
//  - rank 0 is the controller (no GPU);
//  - each engine's TP group sits on one node (a TP group split across nodes is a performance
//    cliff), on consecutive GPUs; engines are placed first, best fit, preferring later nodes;
//  - trainer roles (actor, critic, ref, reward) then take the remaining ranks in rank order; a
//    role with colocate_with shares the ranks (and GPUs) of the role it names;
//  - a rank's GPU index is its position among the worker ranks of its node;
//  - cluster.hybrid: no engine ranks; engine e runs in the processes of actor group ranks
//    [e * tp, (e + 1) * tp), which must share a node.
// An impossible request throws ConfigError saying what to change.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tiller/core/config.h"
#include "tiller/core/roles.h"

namespace tiller::dist {

// Which world ranks run on which node, and how many GPUs each node has.
struct NodeMap {
  struct Node {
    std::string host;        // for messages; may be empty
    std::vector<int> ranks;  // world ranks on this node, ascending
    int gpus = 0;            // GPUs on this node; -1: CPU run (any number of ranks, no GPU index)
  };
  std::vector<Node> nodes;  // ordered by their lowest rank

  int world_size() const;
  // `rank`'s index among the ranks of its node, and how many ranks that node runs.
  // Throws if `rank` is on no node.
  struct LocalPosition {
    int index = 0;
    int ranks_on_node = 0;
  };
  LocalPosition local_position(int rank) const;
  // The placement `mpirun --map-by slot` makes from a hostfile whose node i has
  // gpus[i] x ranks_per_gpu slots, plus one on node 0 for the controller: ranks fill node 0
  // first, then node 1, ... Throws ConfigError if the nodes have fewer slots than world_size.
  static NodeMap fill_by_slot(const std::vector<int>& gpus_per_node, int world_size, int ranks_per_gpu = 1);
};

struct RoleGroup {
  Role role = Role::kActor;
  std::vector<int> ranks;              // the group's world ranks, ascending; group rank i = ranks[i]
  std::string colocated_with;          // "" or the role whose ranks these are
  int sequence_parallel = 1;           // consecutive ranks that share each micro-batch (roles.<r>.sequence_parallel)
};

struct EngineGroup {
  int index = 0;
  int node = 0;
  std::vector<int> ranks;  // TP rank i = ranks[i], consecutive GPUs of `node`
};

struct RankAssignment {
  int rank = 0;
  int node = 0;
  int gpu = -1;                     // -1: the controller, or a CPU run
  std::vector<std::string> roles;   // "controller", trainer roles (canonical order), or "engine"
  RoleSet trainer_roles;            // the trainer roles among them
  int engine = -1;                  // engine index, or -1
  int engine_tp_rank = -1;

  // "controller", "actor+ref", "engine1.tp0": the log prefix of this rank.
  std::string label() const;
};

struct RankPlan {
  int world_size = 0;
  int controller = 0;
  std::vector<RoleGroup> groups;       // enabled trainer roles in the canonical order (core/roles.h)
  std::vector<EngineGroup> engines;
  std::vector<RankAssignment> ranks;   // indexed by world rank
  // cluster.hybrid: the engines run in the actor ranks' processes (engine e on actor group ranks
  // [e * tp, (e + 1) * tp)); a rank can then be both a trainer and an engine rank.
  bool hybrid = false;

  // The group of `role`, or nullptr if the role is disabled (or the name is no role).
  const RoleGroup* group(Role role) const;
  const RoleGroup* group(std::string_view role) const;
  // Ranks of each engine (engines.tp, as the plan placed them); 1 when there are none.
  int engine_tp() const { return engines.empty() ? 1 : static_cast<int>(engines.front().ranks.size()); }
  // A human-readable table of every rank and a summary of the groups.
  std::string table() const;
};

// Ranks the config needs: 1 controller + non-colocated trainer roles' gpus + engines x tp.
int required_world_size(const JobConfig& config);

// cluster.device and cluster.backend resolved on a rank that sees `gpus` CUDA devices (`have_nccl`:
// this build has NCCL): auto is CUDA with NCCL when both are there, else the CPU with MPI.
// ConfigError naming the rank (`rank`, `host`) for cuda without a GPU, or nccl on the CPU.
struct DeviceChoice {
  bool cpu = true;
  BackendKind backend = BackendKind::kMpi;
};
DeviceChoice choose_device(const ClusterConfig& cluster, int gpus, bool have_nccl, int rank, const std::string& host);
// A layout this version refuses on `backend`, as a ConfigError saying what to use instead: hybrid
// engines at TP > 1 over NCCL whose trainers score while they generate (cluster.hybrid_scoring =
// overlap; docs/training.md, the hybrid engine).
void check_layout_on_backend(const JobConfig& config, BackendKind backend);
// One line saying where required_world_size comes from, e.g. "1 controller + 4 actor + 8 engine (2 x TP 4)".
std::string world_size_breakdown(const JobConfig& config);

RankPlan make_rank_plan(const JobConfig& config, const NodeMap& nodes);

// The mpirun line that launches `tiller train` with this plan's placement (see NodeMap::fill_by_slot),
// and the hostfile it reads (empty for one node). `config_path` and `overrides` are passed through.
// `cpu` (cluster.device = cpu): ranks may outnumber cores (--oversubscribe) and no NCCL variables.
struct LaunchCommand {
  std::string hostfile;  // "node0 slots=9\nnode1 slots=8\n"
  std::string command;
};
LaunchCommand mpirun_command(const std::vector<int>& gpus_per_node, int world_size, int ranks_per_gpu,
                             const std::string& config_path,
                             const std::vector<std::string>& overrides, bool cpu = false);

}  // namespace tiller::dist
