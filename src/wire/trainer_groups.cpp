#include "wire/trainer_groups.h"

#include <algorithm>
#include <set>

#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::wire {

RoleSet scored_roles(bool score_actor, RoleSet held) {
  RoleSet out;
  for (Role r : kRoles)
    if (held.has(r) && (score_actor || r != Role::kActor)) out.add(r);
  return out;
}

std::vector<TrainerGroup> scoring_groups(const std::vector<TrainerGroup>& groups, bool score_actor) {
  std::vector<TrainerGroup> out;
  for (TrainerGroup g : groups) {
    g.roles = scored_roles(score_actor, g.roles);
    if (!g.roles.empty()) out.push_back(std::move(g));
  }
  return out;
}

std::string TrainerGroup::name() const {
  std::string out;
  for (Role r : kRoles)
    if (roles.has(r)) out += (out.empty() ? "" : "+") + std::string(role_name(r));
  return out;
}

std::vector<TrainerGroup> trainer_groups(const dist::RankPlan& plan) {
  std::vector<TrainerGroup> out;
  for (const auto& g : plan.groups)
    if (g.colocated_with.empty()) {
      TrainerGroup t;
      t.ranks = g.ranks;
      t.roles.add(g.role);
      t.sequence_parallel = std::max(1, g.sequence_parallel);
      TILLER_CHECK(t.ranks.size() % static_cast<size_t>(t.sequence_parallel) == 0,
                   "rank plan: {} ranks of {} in sequence groups of {}", t.ranks.size(), role_name(g.role),
                   t.sequence_parallel);
      out.push_back(t);
    }
  for (const auto& g : plan.groups) {
    if (g.colocated_with.empty()) continue;
    auto host = std::find_if(out.begin(), out.end(), [&](const TrainerGroup& t) { return t.ranks == g.ranks; });
    TILLER_CHECK(host != out.end(), "rank plan: {} is colocated with {}, whose ranks differ", role_name(g.role),
                 g.colocated_with);
    host->roles.add(g.role);
  }
  return out;
}

std::vector<int> trainer_ranks(const std::vector<TrainerGroup>& groups) {
  std::set<int> ranks;
  for (const auto& g : groups) ranks.insert(g.ranks.begin(), g.ranks.end());
  return {ranks.begin(), ranks.end()};
}

}  // namespace tiller::wire
