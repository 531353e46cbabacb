// One trainer group's scoring of one step's samples (private to src/controller): log-probs and
// entropy (actor), reference log-probs, values (critic) and reward-model scores, for whichever
// roles the group's ranks hold.
//
// Samples are added as they join the step; a StreamingPacker (packer.h) turns them into lockstep
// rounds of packed micro-batches, one per data-parallel rank of the group (an empty one when there
// is nothing for it: ZeRO-3 runs collectives); under sequence parallelism each micro-batch is cut
// into its sequence group's slices, and the slices' answers are joined in order. At most kRoundsInFlight rounds are posted at a time, so the
// messages waiting at slow ranks stay bounded; the rest wait in the packer. Answers go straight
// into the step's host arrays.
//
// The Rollout and totals passed to post() must stay where they are until done(): the answers'
// handlers write to them.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "tiller/controller/experience.h"
#include "tiller/controller/packer.h"
#include "wire/channel.h"
#include "wire/trainer_groups.h"

namespace tiller::controller {

// What the scoring of a step came to, summed over the groups.
struct ScoreTotals {
  std::array<double, kRoleCount> seconds{};  // compute seconds per role, summed over its ranks
  std::array<int64_t, kRoleCount> tokens{};  // tokens each role scored (over all its ranks)
  std::array<double, kRoleCount> bench{};    // the fastest rank's scoring benchmark (tokens/s; 0: none)
  double entropy_sum = 0;                    // the actor's entropy over response tokens
  int64_t entropy_tokens = 0;
  int64_t rounds = 0;
};

class ScoreRounds {
 public:
  static constexpr int kRoundsInFlight = 4;

  // `budget`: tokens per micro-batch and rank (rollout.micro_batch_tokens); `timeout_s`: how long a rank
  // may take over one micro-batch once it is free to.
  ScoreRounds(const wire::TrainerGroup& group, int64_t budget, double temperature, double timeout_s);

  void add(int64_t sample, int64_t tokens);
  // Posts the rounds that are due (with `flush`, whatever is pending: no sample will follow).
  void post(wire::TrainerLink& link, Rollout& ro, ScoreTotals& totals, bool flush);
  int64_t added() const { return added_; }
  int64_t scored() const { return *scored_; }
  bool done() const { return packer_.pending() == 0 && *in_flight_ == 0; }

 private:
  const wire::TrainerGroup* group_;
  StreamingPacker packer_;
  double temperature_, timeout_s_;
  int64_t added_ = 0;
  // Shared with the answers' handlers.
  std::shared_ptr<int64_t> in_flight_ = std::make_shared<int64_t>(0);
  std::shared_ptr<int64_t> scored_ = std::make_shared<int64_t>(0);
};

}  // namespace tiller::controller
