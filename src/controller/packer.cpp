#include "tiller/controller/packer.h"

#include <algorithm>
#include <numeric>

#include "tiller/core/error.h"

namespace tiller::controller {

double sample_cost(int64_t tokens, double attention_tokens) {
  const auto n = static_cast<double>(tokens);
  return attention_tokens > 0 ? n + n * n / attention_tokens : n;
}

std::vector<Round> plan_rounds(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens, int ranks,
                               int64_t budget, double attention_tokens) {
  TILLER_CHECK(ranks >= 1 && budget >= 1, "plan_rounds: {} ranks, budget {}", ranks, budget);
  auto len = [&](int64_t s) { return tokens.at(static_cast<size_t>(s)); };
  // Costliest first (ties: in the order given). The plan depends on that order and the lengths,
  // never on the ids' values: the training's ids number samples as they arrived, which timing
  // decides, and a micro-batch's rows in another order sum its gradient in another order.
  std::vector<int64_t> order = samples;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len(a) > len(b); });
  // The fewest rounds: first-fit decreasing counts the micro-batches the budget needs.
  std::vector<int64_t> bins;
  for (int64_t s : order) {
    auto it = std::find_if(bins.begin(), bins.end(), [&](int64_t used) { return used + len(s) <= budget; });
    if (it == bins.end()) bins.push_back(len(s));
    else *it += len(s);
  }
  size_t rounds = std::max<size_t>(1, (bins.size() + static_cast<size_t>(ranks) - 1) / static_cast<size_t>(ranks));
  struct Slot {
    std::vector<int64_t> ids;
    int64_t tokens = 0;
    double cost = 0;
  };
  std::vector<Slot> slots;
  for (;;) {
    // Longest processing time first over every slot of every round, within the budget.
    slots.assign(rounds * static_cast<size_t>(ranks), Slot{});
    bool fits = true;
    for (int64_t s : order) {
      Slot* best = nullptr;
      for (auto& slot : slots)
        if ((slot.ids.empty() || slot.tokens + len(s) <= budget) && (!best || slot.cost < best->cost)) best = &slot;
      if (!best) {
        fits = false;
        break;
      }
      best->ids.push_back(s);
      best->tokens += len(s);
      best->cost += sample_cost(len(s), attention_tokens);
    }
    if (fits) break;
    ++rounds;  // first-fit found room that the cost order did not: one more round
  }
  // Rounds of similar micro-batches: a round's time is its slowest rank's.
  std::stable_sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) { return a.cost > b.cost; });
  std::vector<size_t> position(tokens.size());
  for (size_t i = 0; i < samples.size(); ++i) position.at(static_cast<size_t>(samples[i])) = i;
  std::vector<Round> out(rounds, Round(static_cast<size_t>(ranks)));
  for (size_t i = 0; i < slots.size(); ++i) {
    std::sort(slots[i].ids.begin(), slots[i].ids.end(), [&](int64_t a, int64_t b) {
      return position[static_cast<size_t>(a)] < position[static_cast<size_t>(b)];
    });
    out[i / static_cast<size_t>(ranks)][i % static_cast<size_t>(ranks)] = std::move(slots[i].ids);
  }
  while (out.size() > 1 && std::all_of(out.back().begin(), out.back().end(), [](const auto& m) { return m.empty(); }))
    out.pop_back();
  return out;
}

StreamingPacker::StreamingPacker(int ranks, int64_t budget) : ranks_(ranks), budget_(budget) {
  TILLER_CHECK(ranks >= 1 && budget >= 1, "StreamingPacker: {} ranks, budget {}", ranks, budget);
}

void StreamingPacker::add(int64_t sample, int64_t tokens) {
  pending_.emplace_back(sample, tokens);
  pending_tokens_ += tokens;
}

std::optional<Round> StreamingPacker::next_round(bool flush) {
  if (pending_.empty()) return std::nullopt;
  if (!flush && pending_tokens_ < static_cast<int64_t>(ranks_) * budget_) return std::nullopt;
  Round round(static_cast<size_t>(ranks_));
  std::vector<int64_t> load(static_cast<size_t>(ranks_), 0);
  std::deque<std::pair<int64_t, int64_t>> left;
  for (const auto& [sample, n] : pending_) {
    const size_t k = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    if (load[k] == 0 || load[k] + n <= budget_) {
      round[k].push_back(sample);
      load[k] += n;
      pending_tokens_ -= n;
    } else {
      left.emplace_back(sample, n);
    }
  }
  pending_ = std::move(left);
  return round;
}

}  // namespace tiller::controller
