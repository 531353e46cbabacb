// The order a dataset is served in, epoch after epoch (the prompt dataset; the SFT, reward-model
// and DPO data): each epoch a permutation of its items, the same on every machine and every run with
// the same seed, and a cursor that a checkpoint keeps so a resumed run serves what follows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tiller::data {

struct DatasetCursor {
  int64_t epoch = 0;
  int64_t position = 0;  // items of this epoch already served
};

// [0, n) shuffled by Fisher-Yates with mt19937_64 seeded with `seed` (both fully specified by the
// standard, unlike std::shuffle).
std::vector<int64_t> shuffled_indices(int64_t n, uint64_t seed);

class EpochOrder {
 public:
  EpochOrder() = default;
  // `n` items; with `shuffle` each epoch's order is shuffled_indices(n, seed * 1000003 + epoch),
  // else 0 .. n - 1.
  EpochOrder(int64_t n, bool shuffle, uint64_t seed);

  int64_t size() const { return n_; }
  // The next k items, continuing into the next epoch when this one ends (n > 0).
  std::vector<int64_t> next(int64_t k);
  DatasetCursor cursor() const { return cursor_; }
  // ConfigError naming `what` ("prompts") when the position is outside an epoch.
  void seek(const DatasetCursor& c, const std::string& what);

 private:
  void order_epoch();

  int64_t n_ = 0;
  bool shuffle_ = false;
  uint64_t seed_ = 0;
  DatasetCursor cursor_;
  std::vector<int64_t> order_;  // this epoch's permutation
};

}  // namespace tiller::data
