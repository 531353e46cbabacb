#include "controller/score_rounds.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "controller/batch.h"
#include "tiller/core/checked_math.h"
#include "tiller/core/error.h"

namespace tiller::controller {

ScoreRounds::ScoreRounds(const wire::TrainerGroup& group, int64_t budget, double temperature, double timeout_s)
    : group_(&group),
      packer_(group.data_parallel(), checked_mul(budget, int64_t{group.sequence_parallel}, "micro_batch_tokens x S")),
      temperature_(temperature),
      timeout_s_(timeout_s) {}

void ScoreRounds::add(int64_t sample, int64_t tokens) {
  packer_.add(sample, tokens);
  ++added_;
}

namespace {

// The answers of one micro-batch's slices, joined in slice order once all are in.
struct SliceAnswers {
  std::vector<wire::ScoreReply> parts;
  size_t left = 0;

  // Per-role tensors of every part, concatenated (undefined when the parts have none).
  static at::Tensor join(const std::vector<wire::ScoreReply>& parts, at::Tensor wire::ScoreReply::*field) {
    std::vector<at::Tensor> ts;
    for (const auto& p : parts)
      if ((p.*field).defined()) ts.push_back(p.*field);
    if (ts.empty()) return {};
    return ts.size() == 1 ? ts[0] : at::cat(ts);
  }
  wire::ScoreReply joined() const {
    wire::ScoreReply r = parts.front();
    for (size_t i = 1; i < parts.size(); ++i)
      for (size_t k = 0; k < r.seconds.size(); ++k) {
        r.seconds[k] += parts[i].seconds[k];
        r.bench[k] = std::max(r.bench[k], parts[i].bench[k]);
      }
    for (auto field : {&wire::ScoreReply::actor_logp, &wire::ScoreReply::actor_entropy, &wire::ScoreReply::critic_values,
                       &wire::ScoreReply::ref_logp, &wire::ScoreReply::reward_scores})
      r.*field = join(parts, field);
    return r;
  }
};

}  // namespace

void ScoreRounds::post(wire::TrainerLink& link, Rollout& ro, ScoreTotals& totals, bool flush) {
  const int sp = group_->sequence_parallel;
  while (*in_flight_ < kRoundsInFlight) {
    std::optional<Round> round = packer_.next_round(flush);
    if (!round) return;
    ++totals.rounds;
    ++*in_flight_;
    // The round's last answer takes it off the count.
    auto answers_left = std::make_shared<size_t>(round->size());
    for (size_t k = 0; k < round->size(); ++k) {
      const wire::PackedSequences whole = pack_sequences(ro, (*round)[k]);
      const RoleSet roles = group_->roles;
      auto answers = std::make_shared<SliceAnswers>();
      answers->parts.resize(static_cast<size_t>(sp));
      answers->left = static_cast<size_t>(sp);
      // Once every slice has answered: into the step's arrays.
      auto finish = [&ro, &totals, samples = (*round)[k], roles, rows = whole.rows(), answers_left,
                     in_flight = in_flight_, scored = scored_](const wire::ScoreReply& r) {
        for (size_t i = 0; i < static_cast<size_t>(kRoleCount); ++i) {
          totals.seconds[i] += r.seconds[i];
          totals.bench[i] = std::max(totals.bench[i], r.bench[i]);
        }
        for (Role role : kRoles)
          if (roles.has(role)) totals.tokens[static_cast<size_t>(role_index(role))] += rows;
        if (roles.has(Role::kActor)) {
          scatter_tokens(ro, ro.logp, samples, r.actor_logp);
          if (ro.layout.turns) {  // the model's tokens only
            const at::Tensor m = gather_mask(ro, samples).to(at::kBool);
            totals.entropy_sum += r.actor_entropy.masked_select(m).to(at::kDouble).sum().item<double>();
            totals.entropy_tokens += m.sum().item<int64_t>();
          } else {
            totals.entropy_sum += r.actor_entropy.to(at::kDouble).sum().item<double>();
            totals.entropy_tokens += r.actor_entropy.numel();
          }
        }
        if (roles.has(Role::kCritic)) scatter_tokens(ro, ro.values, samples, r.critic_values);
        if (roles.has(Role::kRef)) scatter_tokens(ro, ro.ref_logp, samples, r.ref_logp);
        if (roles.has(Role::kReward)) {
          if (r.reward_scores.numel() != static_cast<int64_t>(samples.size()))
            throw CommError(fmt::format("{} reward scores for {} samples", r.reward_scores.numel(), samples.size()));
          const float* p = r.reward_scores.data_ptr<float>();
          for (size_t i = 0; i < samples.size(); ++i) ro.score[static_cast<size_t>(samples[i])] = p[i];
        }
        *scored += static_cast<int64_t>(samples.size());
        if (--*answers_left == 0) --*in_flight;
      };
      const std::vector<wire::PackedSequences> slices = whole.cut(sp);
      for (int j = 0; j < sp; ++j) {
        wire::ScoreRequest req;
        req.batch = slices[static_cast<size_t>(j)];
        req.temperature = temperature_;
        const wire::PackedSequences asked = req.batch;
        link.call(group_->ranks[k * static_cast<size_t>(sp) + static_cast<size_t>(j)], req.encode(), timeout_s_,
                  "scoring", [asked, roles, answers, j, finish](wire::Frame&& f) {
                    wire::ScoreReply r = wire::ScoreReply::decode(std::move(f), asked);
                    if (!(r.roles == roles))
                      throw CommError(
                          fmt::format("it answered for roles {:x}, it holds {:x}", r.roles.bits(), roles.bits()));
                    answers->parts[static_cast<size_t>(j)] = std::move(r);
                    if (--answers->left == 0) finish(answers->parts.size() == 1 ? answers->parts[0] : answers->joined());
                  });
      }
    }
  }
}

}  // namespace tiller::controller
