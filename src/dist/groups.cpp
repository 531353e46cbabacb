#include "tiller/dist/groups.h"

#include <algorithm>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::dist {

std::vector<int> weight_sync_ranks(const RankPlan& plan) {
  const RoleGroup* actor = plan.group(Role::kActor);
  if (!actor || plan.engines.empty()) return {};
  std::vector<int> out = actor->ranks;
  if (plan.hybrid) return out;  // the engines are in these ranks' processes
  for (const auto& e : plan.engines) out.insert(out.end(), e.ranks.begin(), e.ranks.end());
  return out;
}

GroupCommunicators make_group_communicators(const RankPlan& plan, Communicator& world) {
  return make_group_communicators(plan, world, nullptr);
}

GroupCommunicators make_group_communicators(const RankPlan& plan, Communicator& world, const DeviceComm& to_device) {
  auto keep = [&](std::unique_ptr<Communicator> comm, const std::string& name) {
    return to_device ? to_device(*comm, name) : std::move(comm);
  };
  TILLER_CHECK(world.size() == plan.world_size, "group communicators: the world has {} ranks but the plan {}",
               world.size(), plan.world_size);
  const int me = world.rank();
  GroupCommunicators out;
  // One split per role, in the plan's order on every rank (the order contract of split).
  for (const auto& group : plan.groups) {
    auto pos = std::find(group.ranks.begin(), group.ranks.end(), me);
    const bool member = pos != group.ranks.end();
    const std::string name(role_name(group.role));
    auto comm = world.split(member ? 0 : -1, member ? static_cast<int>(pos - group.ranks.begin()) : 0, name);
    if (member) {
      TILLER_CHECK(comm != nullptr && comm->size() == static_cast<int>(group.ranks.size()),
                   "group communicators: '{}' came out with the wrong size", name);
      out.roles[group.role] = keep(std::move(comm), name);
    }
  }
  // All engine TP groups in one split: color = engine index.
  const auto& mine = plan.ranks[me];
  if (!plan.engines.empty()) {
    auto comm = world.split(mine.engine, std::max(mine.engine_tp_rank, 0), fmt::format("engine{}.tp", mine.engine));
    if (mine.engine >= 0) {
      // Split before the group goes to the device: collective over the engine's ranks alone.
      if (plan.hybrid && to_device && comm->size() > 1)
        out.engine_control = comm->split(0, comm->rank(), fmt::format("engine{}.control", mine.engine));
      out.engine_tp = keep(std::move(comm), fmt::format("engine{}.tp", mine.engine));
    }
  }
  const std::vector<int> sync = weight_sync_ranks(plan);
  if (!sync.empty()) {
    auto pos = std::find(sync.begin(), sync.end(), me);
    const bool member = pos != sync.end();
    auto comm = world.split(member ? 0 : -1, member ? static_cast<int>(pos - sync.begin()) : 0, "weight_sync");
    if (member) out.weight_sync = keep(std::move(comm), "weight_sync");
  }
  return out;
}

}  // namespace tiller::dist
