// The communicators a rank needs, made from the rank plan: one per trainer role it takes part in
// (a colocated role gets its own communicator over the same ranks, so its collectives never
// have to be ordered with the host role's), one for its engine's TP group, and the weight sync's
// (the actor group and every engine rank).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tiller/dist/communicator.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::dist {

struct GroupCommunicators {
  std::map<Role, std::unique_ptr<Communicator>> roles;  // only this rank's roles
  std::unique_ptr<Communicator> engine_tp;                     // null unless this rank is an engine rank
  // The same TP group over the host (the world's backend, MPI), for the engine's control messages
  // (engine/engine.h): made only for hybrid plans whose groups go to a device (to_device), where
  // a follower waiting on the device for its leader's next message would leave a collective
  // pending on the GPU its trainer shares. Null otherwise: the control goes over engine_tp.
  std::unique_ptr<Communicator> engine_control;
  // The weight sync's (sync/weight_sync.h): the actor group's ranks first (sync rank i = actor
  // rank i), then every engine's ranks in engine and TP order. Null on other ranks, and when the
  // plan has no actor or no engine. Hybrid (RankPlan::hybrid): the actor group's ranks alone, each
  // of which also hosts its engine rank (sync/hybrid_handoff.h).
  std::unique_ptr<Communicator> weight_sync;

  Communicator* role(Role r) const {
    auto it = roles.find(r);
    return it == roles.end() ? nullptr : it->second.get();
  }
};

// Collective over `world`: every rank calls it with the same plan. `world.rank()` must be the
// plan's world rank. Group rank i is the plan group's ranks[i] (TP rank i for engines).
GroupCommunicators make_group_communicators(const RankPlan& plan, Communicator& world);

// The same, with each group's communicator (made by splitting `world`) handed to `to_device`,
// which every member calls with the group's name and returns the communicator to keep (an NCCL
// communicator over the same ranks, made collectively over the split one). This is how a job
// whose controller has no GPU gets NCCL groups: `world` is MPI, the groups are NCCL.
using DeviceComm = std::function<std::unique_ptr<Communicator>(Communicator& group, const std::string& name)>;
GroupCommunicators make_group_communicators(const RankPlan& plan, Communicator& world, const DeviceComm& to_device);

// A communicator for CUDA tensors over a CPU one (MPI): every operation copies to the host, runs
// there and copies back before it returns (its Work is complete at once). For groups that NCCL
// refuses: two ranks on one GPU (cluster.ranks_per_gpu > 1). Host bandwidth, no overlap.
std::unique_ptr<Communicator> host_staged(std::unique_ptr<Communicator> cpu);

// Collective over `group` (a CPU communicator): whether two of its ranks have the same
// (node, device), each rank passing its own.
bool shares_a_device(Communicator& group, int64_t node, int64_t device);

// The world ranks of the weight sync communicator, in its rank order (empty without an actor
// group or engines).
std::vector<int> weight_sync_ranks(const RankPlan& plan);

}  // namespace tiller::dist
