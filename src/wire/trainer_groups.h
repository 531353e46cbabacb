// The controller's view of the trainer ranks (private to src/wire): one TrainerGroup per set of
// ranks, with every role those ranks hold (a role colocated with another shares its ranks, so the
// two take the same messages: one score request gets both roles' answers).
#pragma once

#include <string>
#include <vector>

#include "tiller/core/roles.h"

namespace tiller::dist {
struct RankPlan;
}

namespace tiller::wire {

struct TrainerGroup {
  std::vector<int> ranks;  // group rank i = ranks[i]
  RoleSet roles;
  // Sequence parallelism: ranks [d S, (d + 1) S) share data-parallel micro-batch d, each taking
  // its slice (PackedSequences::cut). S = 1: every rank is its own data-parallel rank.
  int sequence_parallel = 1;
  int data_parallel() const { return static_cast<int>(ranks.size()) / sequence_parallel; }
  bool has(Role r) const { return roles.has(r); }
  bool trains() const { return roles.has(Role::kActor) || roles.has(Role::kCritic); }
  std::string name() const;  // "actor+ref"
};

// The plan's groups, hosts in the canonical order of their first role.
std::vector<TrainerGroup> trainer_groups(const dist::RankPlan& plan);

// The roles among `held` that answer score requests: all of them, but the actor when
// train.old_logprobs = forward (its training forward gives the old log-probs).
RoleSet scored_roles(bool score_actor, RoleSet held);
// The groups that take score requests, each with its scored roles (groups left with none dropped).
std::vector<TrainerGroup> scoring_groups(const std::vector<TrainerGroup>& groups, bool score_actor);

// Every trainer rank once, ascending.
std::vector<int> trainer_ranks(const std::vector<TrainerGroup>& groups);

}  // namespace tiller::wire
