// A point in time by which a blocking call must return. Every blocking call in tiller takes one
// (or a timeout from the config's `timeouts` section that becomes one).
#pragma once

#include <chrono>

namespace tiller {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  // A duration past ~30 years (or not a number) is no deadline at all: the sum would overflow.
  static Deadline after(std::chrono::duration<double> d) {
    if (!(d.count() < kForeverSeconds)) return never();
    return Deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(d));
  }
  static Deadline after_seconds(double s) { return after(std::chrono::duration<double>(s)); }
  // No deadline at all: only for calls whose caller enforces one some other way.
  static Deadline never() { return Deadline(Clock::time_point::max()); }

  bool expired() const { return Clock::now() >= at_; }
  bool is_never() const { return at_ == Clock::time_point::max(); }
  Clock::time_point at() const { return at_; }
  // Seconds left (0 once expired).
  double remaining_seconds() const {
    if (is_never()) return 1e300;
    auto left = std::chrono::duration<double>(at_ - Clock::now()).count();
    return left > 0 ? left : 0.0;
  }

 private:
  static constexpr double kForeverSeconds = 1e9;
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

}  // namespace tiller
