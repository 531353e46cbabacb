#include "rollout/score_rounds.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "rollout/batch.h"
#include "tiller/core/error.h"

namespace tiller::rollout {

ScoreRounds::ScoreRounds(const TrainerGroup& group, int64_t budget, double temperature, double timeout_s)
    : group_(&group),
      packer_(static_cast<int>(group.ranks.size()), budget),
      temperature_(temperature),
      timeout_s_(timeout_s) {}

void ScoreRounds::add(int64_t sample, int64_t tokens) {
  packer_.add(sample, tokens);
  ++added_;
}

void ScoreRounds::post(TrainerLink& link, Rollout& ro, ScoreTotals& totals, bool flush) {
  while (*in_flight_ < kRoundsInFlight) {
    std::optional<Round> round = packer_.next_round(flush);
    if (!round) return;
    ++totals.rounds;
    ++*in_flight_;
    // The round's last answer takes it off the count.
    auto answers_left = std::make_shared<size_t>(round->size());
    for (size_t k = 0; k < round->size(); ++k) {
      ScoreRequest req;
      req.batch = pack_sequences(ro, (*round)[k]);
      req.temperature = temperature_;
      const PackedSequences asked = req.batch;
      const RoleSet roles = group_->roles;
      link.call(group_->ranks[k], req.encode(), timeout_s_, "scoring",
                [&ro, &totals, samples = std::move((*round)[k]), asked, roles, answers_left, in_flight = in_flight_,
                 scored = scored_](Frame&& f) {
                  const ScoreReply r = ScoreReply::decode(std::move(f), asked);
                  if (!(r.roles == roles))
                    throw CommError(fmt::format("it answered for roles {:x}, it holds {:x}", r.roles.bits(), roles.bits()));
                  for (int i = 0; i < kRoleCount; ++i) totals.seconds[static_cast<size_t>(i)] += r.seconds[static_cast<size_t>(i)];
                  if (roles.has(Role::kActor)) {
                    scatter_tokens(ro, ro.logp, samples, r.actor_logp);
                    totals.entropy_sum += r.actor_entropy.to(at::kDouble).sum().item<double>();
                    totals.entropy_tokens += r.actor_entropy.numel();
                  }
                  if (roles.has(Role::kCritic)) scatter_tokens(ro, ro.values, samples, r.critic_values);
                  if (roles.has(Role::kRef)) scatter_tokens(ro, ro.ref_logp, samples, r.ref_logp);
                  if (roles.has(Role::kReward)) {
                    const float* p = r.reward_scores.data_ptr<float>();
                    for (size_t i = 0; i < samples.size(); ++i) ro.score[static_cast<size_t>(samples[i])] = p[i];
                  }
                  *scored += static_cast<int64_t>(samples.size());
                  if (--*answers_left == 0) --*in_flight;
                });
    }
  }
}

}  // namespace tiller::rollout
