// The communicators a rank needs, made from the rank plan: one per trainer role it takes part in
// (a colocated role gets its own communicator over the same ranks, so its collectives never
// have to be ordered with the host role's) and one for its engine's TP group.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "tiller/dist/communicator.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::dist {

struct GroupCommunicators {
  std::map<std::string, std::unique_ptr<Communicator>> roles;  // "actor", "ref", ...: only this rank's roles
  std::unique_ptr<Communicator> engine_tp;                     // null unless this rank is an engine rank

  Communicator* role(const std::string& name) const {
    auto it = roles.find(name);
    return it == roles.end() ? nullptr : it->second.get();
  }
};

// Collective over `world`: every rank calls it with the same plan. `world.rank()` must be the
// plan's world rank. Group rank i is the plan group's ranks[i] (TP rank i for engines).
GroupCommunicators make_group_communicators(const RankPlan& plan, Communicator& world);

}  // namespace tiller::dist
