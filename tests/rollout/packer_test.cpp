// The packing of samples into lockstep micro-batch rounds, and the TensorBoard record checksum.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "tiller/rollout/metrics.h"
#include "tiller/rollout/packer.h"

namespace tiller::rollout {
namespace {

int64_t tokens_of(const std::vector<int64_t>& ids, const std::vector<int64_t>& tokens) {
  int64_t n = 0;
  for (int64_t s : ids) n += tokens[static_cast<size_t>(s)];
  return n;
}

TEST(Packer, BalanceSpreadsTokensAndKeepsEverySample) {
  const std::vector<int64_t> tokens = {100, 10, 10, 10, 10, 50, 50, 20};
  std::vector<int64_t> all(tokens.size());
  std::iota(all.begin(), all.end(), 0);
  const auto parts = balance(all, tokens, 3);
  ASSERT_EQ(parts.size(), 3u);
  std::vector<int64_t> seen;
  for (const auto& p : parts) {
    EXPECT_TRUE(std::is_sorted(p.begin(), p.end()));
    seen.insert(seen.end(), p.begin(), p.end());
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, all);
  // Longest first onto the lightest: {100}, {50, 10, 10}, {50, 20, 10, 10}: loads 100, 70, 90.
  EXPECT_EQ(parts[0], (std::vector<int64_t>{0}));
  EXPECT_EQ(tokens_of(parts[1], tokens) + tokens_of(parts[2], tokens), 160);
  EXPECT_LE(std::abs(tokens_of(parts[1], tokens) - tokens_of(parts[2], tokens)), 20);
}

TEST(Packer, PackRespectsTheBudgetAndPutsLongSamplesAlone) {
  const std::vector<int64_t> tokens = {30, 30, 50, 200, 10, 10};
  const auto mbs = pack({0, 1, 2, 3, 4, 5}, tokens, 64);
  ASSERT_EQ(mbs.size(), 4u);
  EXPECT_EQ(mbs[0], (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(mbs[1], (std::vector<int64_t>{2}));
  EXPECT_EQ(mbs[2], (std::vector<int64_t>{3}));  // over the budget: alone
  EXPECT_EQ(mbs[3], (std::vector<int64_t>{4, 5}));
}

TEST(Packer, PlanRoundsGivesEveryRankARoundEvenWhenEmpty) {
  const std::vector<int64_t> tokens = {40, 40, 40, 40, 40};
  const auto rounds = plan_rounds({0, 1, 2, 3, 4}, tokens, 4, 64);
  // 5 samples over 4 ranks: one rank has 2 (two micro-batches of 40 > 64 together), the others 1.
  ASSERT_EQ(rounds.size(), 2u);
  std::set<int64_t> seen;
  int empty = 0;
  for (const auto& round : rounds) {
    ASSERT_EQ(round.size(), 4u);
    for (const auto& mb : round) {
      if (mb.empty()) ++empty;
      EXPECT_LE(tokens_of(mb, tokens), 64);
      seen.insert(mb.begin(), mb.end());
    }
  }
  EXPECT_EQ(seen.size(), 5u);
  EXPECT_EQ(empty, 3);
  // No samples at all: still one round of empty micro-batches (the group's collectives run).
  const auto none = plan_rounds({}, tokens, 2, 64);
  ASSERT_EQ(none.size(), 1u);
  EXPECT_TRUE(none[0][0].empty() && none[0][1].empty());
}

TEST(Packer, StreamingRoundsWaitForAFullRoundThenFlush) {
  StreamingPacker p(2, 100);
  p.add(0, 60);
  p.add(1, 60);
  EXPECT_FALSE(p.next_round(false).has_value());  // 120 < 2 x 100
  p.add(2, 60);
  p.add(3, 30);
  auto r = p.next_round(false);  // 210 >= 200
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->size(), 2u);
  int64_t taken = 0;
  for (const auto& mb : *r) {
    EXPECT_LE(tokens_of(mb, {60, 60, 60, 30}), 100);
    taken += static_cast<int64_t>(mb.size());
  }
  EXPECT_EQ(taken + static_cast<int64_t>(p.pending()), 4);
  EXPECT_GT(taken, 0);
  while (p.pending() > 0) ASSERT_TRUE(p.next_round(true).has_value());
  EXPECT_EQ(p.pending_tokens(), 0);
  EXPECT_FALSE(p.next_round(true).has_value());
  // A sample over the budget still leaves, alone on its rank.
  p.add(9, 500);
  auto big = p.next_round(false);
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ((*big)[0], (std::vector<int64_t>{9}));
}

TEST(Metrics, Crc32cMatchesTheStandardCheckValues) {
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);  // the CRC-32C check value
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8a9136aau);  // RFC 3720 B.4
}

}  // namespace
}  // namespace tiller::rollout
