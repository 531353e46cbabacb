// Packing samples into token-budget micro-batches for lockstep groups (DESIGN.md §3).
//
// A ZeRO-3 group runs collectives, so all of its ranks take one micro-batch each per round (an
// empty one when there is nothing for them). The functions here decide which samples go to which
// rank in which round; they know only sample ids and token counts, so they are tested without a
// model. A micro-batch holds whole samples and at most `budget` tokens, except a single sample
// longer than the budget, which goes alone.
//
// StreamingPacker forms scoring rounds while generation runs: completions are added as they
// arrive, and a round is released as soon as the pending samples fill every rank's budget (or,
// at the end, whatever is left). plan_rounds schedules a training optimizer step: the step's
// samples are balanced over the ranks by tokens, each rank's share is packed into micro-batches,
// and ranks with fewer micro-batches get empty ones so every rank runs the same number of rounds.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

namespace tiller::rollout {

// One round: round[k] are the sample ids rank k takes (possibly none).
using Round = std::vector<std::vector<int64_t>>;

// Splits `samples` over `parts` ranks, longest first onto the rank with the fewest tokens; each
// part lists its samples in ascending id order. tokens[s] is sample s's token count.
std::vector<std::vector<int64_t>> balance(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens,
                                          int parts);
// Packs `samples` in order into micro-batches of at most `budget` tokens.
std::vector<std::vector<int64_t>> pack(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens,
                                       int64_t budget);
// The lockstep rounds of one optimizer step over `ranks` ranks (see above).
std::vector<Round> plan_rounds(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens, int ranks,
                               int64_t budget);

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

}  // namespace tiller::rollout
