#include "tiller/rollout/packer.h"

#include <algorithm>
#include <numeric>

#include "tiller/core/error.h"

namespace tiller::rollout {

std::vector<std::vector<int64_t>> balance(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens,
                                          int parts) {
  TILLER_CHECK(parts >= 1, "balance: {} parts", parts);
  std::vector<int64_t> order = samples;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tokens.at(static_cast<size_t>(a)) > tokens.at(static_cast<size_t>(b)); });
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(parts));
  std::vector<int64_t> load(static_cast<size_t>(parts), 0);
  for (int64_t s : order) {
    const size_t k = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    out[k].push_back(s);
    load[k] += tokens[static_cast<size_t>(s)];
  }
  for (auto& part : out) std::sort(part.begin(), part.end());
  return out;
}

std::vector<std::vector<int64_t>> pack(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens,
                                       int64_t budget) {
  TILLER_CHECK(budget >= 1, "pack: budget {}", budget);
  std::vector<std::vector<int64_t>> out;
  int64_t used = 0;
  for (int64_t s : samples) {
    const int64_t n = tokens.at(static_cast<size_t>(s));
    if (out.empty() || (used + n > budget && !out.back().empty())) {
      out.emplace_back();
      used = 0;
    }
    out.back().push_back(s);
    used += n;
  }
  return out;
}

std::vector<Round> plan_rounds(const std::vector<int64_t>& samples, const std::vector<int64_t>& tokens, int ranks,
                               int64_t budget) {
  std::vector<std::vector<std::vector<int64_t>>> per_rank;
  size_t rounds = 0;
  for (const auto& share : balance(samples, tokens, ranks)) {
    per_rank.push_back(pack(share, tokens, budget));
    rounds = std::max(rounds, per_rank.back().size());
  }
  rounds = std::max<size_t>(rounds, 1);  // a step with no samples still runs one (empty) round
  std::vector<Round> out(rounds, Round(static_cast<size_t>(ranks)));
  for (size_t k = 0; k < per_rank.size(); ++k)
    for (size_t r = 0; r < per_rank[k].size(); ++r) out[r][k] = per_rank[k][r];
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

}  // namespace tiller::rollout
