// The packing of samples into lockstep micro-batch rounds, and the TensorBoard record checksum.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "tiller/controller/metrics.h"
#include "tiller/controller/packer.h"

namespace tiller::controller {
namespace {

int64_t tokens_of(const std::vector<int64_t>& ids, const std::vector<int64_t>& tokens) {
  int64_t n = 0;
  for (int64_t s : ids) n += tokens[static_cast<size_t>(s)];
  return n;
}

// Every sample exactly once, every micro-batch within the budget unless it is one long sample
// (the samples are given in id order here, so each micro-batch lists them ascending).
void expect_valid(const std::vector<Round>& rounds, const std::vector<int64_t>& tokens, int ranks, int64_t budget,
                  size_t samples) {
  std::multiset<int64_t> seen;
  for (const auto& round : rounds) {
    ASSERT_EQ(round.size(), static_cast<size_t>(ranks));
    for (const auto& mb : round) {
      EXPECT_TRUE(std::is_sorted(mb.begin(), mb.end()));
      if (mb.size() > 1) EXPECT_LE(tokens_of(mb, tokens), budget);
      seen.insert(mb.begin(), mb.end());
    }
  }
  EXPECT_EQ(seen.size(), samples);
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), samples);
}

TEST(Packer, PlanRoundsUsesTheFewestRoundsAndSpreadsSmallSamples) {
  // 8 samples of 10 tokens over 4 ranks, budget 64: one round, two samples per rank (not 6 + 2).
  const std::vector<int64_t> tokens(8, 10);
  const auto rounds = plan_rounds({0, 1, 2, 3, 4, 5, 6, 7}, tokens, 4, 64);
  expect_valid(rounds, tokens, 4, 64, 8);
  ASSERT_EQ(rounds.size(), 1u);
  for (const auto& mb : rounds[0]) EXPECT_EQ(mb.size(), 2u);
}

TEST(Packer, ALongSamplesRoundHoldsTheFullestMicroBatches) {
  // One 4000-token sample (over the budget: alone) and 16 of 500, over 2 ranks at a budget of 2000.
  std::vector<int64_t> tokens = {4000};
  for (int i = 0; i < 16; ++i) tokens.push_back(500);
  std::vector<int64_t> all(tokens.size());
  std::iota(all.begin(), all.end(), 0);
  const auto rounds = plan_rounds(all, tokens, 2, 2000, 2000.0);
  expect_valid(rounds, tokens, 2, 2000, tokens.size());
  // 1 + 4 micro-batches of 2000: 3 rounds; the long sample's round has a full micro-batch beside it.
  ASSERT_EQ(rounds.size(), 3u);
  EXPECT_EQ(rounds[0][0], (std::vector<int64_t>{0}));
  EXPECT_EQ(tokens_of(rounds[0][1], tokens), 2000);
}

TEST(Packer, AttentionCostMovesWorkAwayFromLongSamples) {
  // Tokens alone balance {900, 100} against {500, 500}; with attention (a 1000-token sequence's
  // attention costs as much as the rest) the 900-token sample is the heavier one, and the
  // 100-token sample joins the 500s.
  const std::vector<int64_t> tokens = {900, 500, 500, 100};
  auto holder_of = [](const Round& r, int64_t s) {
    for (size_t k = 0; k < r.size(); ++k)
      if (std::count(r[k].begin(), r[k].end(), s)) return k;
    return r.size();
  };
  const auto by_tokens = plan_rounds({0, 1, 2, 3}, tokens, 2, 100000);
  ASSERT_EQ(by_tokens.size(), 1u);
  EXPECT_EQ(holder_of(by_tokens[0], 3), holder_of(by_tokens[0], 0));
  const auto by_cost = plan_rounds({0, 1, 2, 3}, tokens, 2, 100000, 1000.0);
  ASSERT_EQ(by_cost.size(), 1u);
  EXPECT_EQ(holder_of(by_cost[0], 3), holder_of(by_cost[0], 1));
  EXPECT_DOUBLE_EQ(sample_cost(1000, 1000.0), 2000.0);
  EXPECT_DOUBLE_EQ(sample_cost(1000, 0), 1000.0);
}

TEST(Packer, PlanRoundsGivesEveryRankARoundEvenWhenEmpty) {
  const std::vector<int64_t> tokens = {40, 40, 40, 40, 40};
  const auto rounds = plan_rounds({0, 1, 2, 3, 4}, tokens, 4, 64);
  // 5 samples over 4 ranks: 5 micro-batches (two samples of 40 exceed 64), so two rounds.
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

TEST(Packer, PlanRoundsDependsOnTheOrderGivenNotOnTheIds) {
  // The training numbers samples in arrival order, which timing decides, and hands them over in a
  // fixed order: the same samples under other ids must get the same micro-batches, their samples
  // in the same order (the gradient's sums follow the rows' order).
  const std::vector<int64_t> lens = {33, 17, 40, 17, 25, 33, 9, 40, 12, 28, 17, 31};
  const std::vector<int64_t> given = {7, 2, 11, 0, 5, 9, 1, 4, 10, 3, 8, 6};
  std::vector<int64_t> relabel(lens.size());  // id s is called relabel[s] in the second run
  std::iota(relabel.begin(), relabel.end(), 0);
  std::reverse(relabel.begin(), relabel.end());
  std::swap(relabel[2], relabel[5]);
  std::vector<int64_t> lens2(lens.size()), given2;
  for (size_t s = 0; s < lens.size(); ++s) lens2[static_cast<size_t>(relabel[s])] = lens[s];
  for (int64_t s : given) given2.push_back(relabel[static_cast<size_t>(s)]);
  for (int ranks : {1, 2, 3}) {
    const auto a = plan_rounds(given, lens, ranks, 80), b = plan_rounds(given2, lens2, ranks, 80);
    ASSERT_EQ(a.size(), b.size()) << ranks << " ranks";
    for (size_t r = 0; r < a.size(); ++r)
      for (size_t k = 0; k < a[r].size(); ++k) {
        std::vector<int64_t> mapped;
        for (int64_t s : a[r][k]) mapped.push_back(relabel[static_cast<size_t>(s)]);
        EXPECT_EQ(mapped, b[r][k]) << ranks << " ranks, round " << r << ", rank " << k;
        // Within a micro-batch the samples keep the order they were given in.
        std::vector<size_t> at;
        for (int64_t s : a[r][k]) at.push_back(static_cast<size_t>(std::find(given.begin(), given.end(), s) - given.begin()));
        EXPECT_TRUE(std::is_sorted(at.begin(), at.end()));
      }
  }
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
}  // namespace tiller::controller
