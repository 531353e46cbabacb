// Packing samples into token-budget micro-batches for lockstep groups (docs/architecture.md).
//
// A ZeRO-3 group runs collectives, so all of its ranks take one micro-batch each per round (an
// empty one when there is nothing for them). The functions here decide which samples go to which
// rank in which round; they know only sample ids and token counts, so they are tested without a
// model. A micro-batch holds whole samples and at most `budget` tokens, except a single sample
// longer than the budget, which goes alone (under sequence parallelism a group of S ranks takes
// each micro-batch, cut into S slices, with S times the per-rank budget).
//
// StreamingPacker forms scoring rounds while generation runs: completions are added as they
// arrive, and a round is released as soon as the pending samples fill every rank's budget (or,
// at the end, whatever is left). plan_rounds schedules a training optimizer step: rounds of
// micro-batches balanced by cost (tokens, plus attention for long samples), and empty micro-batches
// where a round has fewer than the ranks, so every rank runs the same number of rounds.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

namespace tiller::controller {

// One round: round[k] are the sample ids rank k takes (possibly none).
using Round = std::vector<std::vector<int64_t>>;

// The work of a sample of `tokens` tokens: its tokens, plus its attention's quadratic share when
// attention_tokens > 0 (the length at which a sequence's attention costs as much as the rest of
// the model; attention_cost_tokens() in model_config.h).
double sample_cost(int64_t tokens, double attention_tokens);

// The lockstep rounds of one optimizer step over `ranks` data-parallel ranks. The rounds are as
// few as the budget allows (first-fit decreasing); the samples go, costliest first, to the
// cheapest micro-batch of any round that has room (a sample over the budget only to an empty
// one); then the micro-batches are sorted by cost and dealt out in rounds, so the costliest run
// side by side and a long sample's round holds the other ranks' fullest micro-batches rather than
// stalling rounds of small ones. Each micro-batch lists its samples in their order in `samples`,
// and the plan depends on that order and the lengths only, not on the ids' values (the same
// samples under other ids get the same plan).
std::vector<Round> plan_rounds(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens, int ranks,
                               int64_t budget, double attention_tokens = 0);

class StreamingPacker {
 public:
  StreamingPacker(int ranks, int64_t budget);

  void add(int64_t sample, int64_t tokens);
  // The next round: when the pending samples hold at least ranks x budget tokens, or with `flush`
  // whenever any sample is pending. Each rank gets at most `budget` tokens (or one longer sample);
  // samples that do not fit stay pending, in arrival order. nullopt when no round is due.
  std::optional<Round> next_round(bool flush);
  int64_t pending_tokens() const { return pending_tokens_; }
  size_t pending() const { return pending_.size(); }

 private:
  int ranks_;
  int64_t budget_;
  std::deque<std::pair<int64_t, int64_t>> pending_;  // (sample, tokens)
  int64_t pending_tokens_ = 0;
};

}  // namespace tiller::controller
