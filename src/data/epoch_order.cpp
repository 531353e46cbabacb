#include "tiller/data/epoch_order.h"

#include <random>
#include <utility>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::data {

std::vector<int64_t> shuffled_indices(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::mt19937_64 gen(seed);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[gen() % i]);
  return order;
}

EpochOrder::EpochOrder(int64_t n, bool shuffle, uint64_t seed) : n_(n), shuffle_(shuffle), seed_(seed) {
  TILLER_CHECK(n >= 0, "EpochOrder of {} items", n);
  order_epoch();
}

void EpochOrder::order_epoch() {
  if (shuffle_) {
    order_ = shuffled_indices(n_, seed_ * 1000003ull + static_cast<uint64_t>(cursor_.epoch));
    return;
  }
  order_.resize(static_cast<size_t>(n_));
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int64_t>(i);
}

std::vector<int64_t> EpochOrder::next(int64_t k) {
  TILLER_CHECK(n_ > 0 || k <= 0, "items drawn from an empty dataset");
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(k, 0)));
  while (static_cast<int64_t>(out.size()) < k) {
    if (cursor_.position == n_) {
      ++cursor_.epoch;
      cursor_.position = 0;
      order_epoch();
    }
    out.push_back(order_[static_cast<size_t>(cursor_.position++)]);
  }
  return out;
}

void EpochOrder::seek(const DatasetCursor& c, const std::string& what) {
  if (c.epoch < 0 || c.position < 0 || c.position > n_)
    throw ConfigError(fmt::format("dataset cursor (epoch {}, position {}) is outside the dataset of {} {}", c.epoch,
                                  c.position, n_, what));
  cursor_ = c;
  order_epoch();
}

}  // namespace tiller::data
