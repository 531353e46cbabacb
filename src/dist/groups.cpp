#include "tiller/dist/groups.h"

#include <algorithm>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::dist {

GroupCommunicators make_group_communicators(const RankPlan& plan, Communicator& world) {
  TILLER_CHECK(world.size() == plan.world_size, "group communicators: the world has {} ranks but the plan {}",
               world.size(), plan.world_size);
  const int me = world.rank();
  GroupCommunicators out;
  // One split per role, in the plan's order on every rank (the order contract of split).
  for (const auto& group : plan.groups) {
    auto pos = std::find(group.ranks.begin(), group.ranks.end(), me);
    const bool member = pos != group.ranks.end();
    auto comm = world.split(member ? 0 : -1, member ? static_cast<int>(pos - group.ranks.begin()) : 0, group.role);
    if (member) {
      TILLER_CHECK(comm != nullptr && comm->size() == static_cast<int>(group.ranks.size()),
                   "group communicators: '{}' came out with the wrong size", group.role);
      out.roles[group.role] = std::move(comm);
    }
  }
  // All engine TP groups in one split: color = engine index.
  const auto& mine = plan.ranks[me];
  if (!plan.engines.empty()) {
    auto comm = world.split(mine.engine, std::max(mine.engine_tp_rank, 0), fmt::format("engine{}.tp", mine.engine));
    if (mine.engine >= 0) out.engine_tp = std::move(comm);
  }
  return out;
}

}  // namespace tiller::dist
