// Time helpers shared by the controller, the ranks and the benchmarks: wall-clock microseconds
// for traces (comparable across the processes of one machine, and across machines as far as
// their clocks agree), steady-clock seconds for durations.
//
// Clock: the time source of deadlines and progress checks, injectable (leveldb's Env::NowMicros):
// the real steady clock in a job, a ManualClock in tests, so that a timeout is tested by moving
// time rather than by waiting for it.
#pragma once

#include <atomic>
#include <chrono>

namespace tiller {

class Clock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  virtual time_point now() const = 0;
  // The process's steady clock (a static object; thread-safe).
  static const Clock& steady();
};

// Time that moves only by advance(); starts at the steady clock's now(). Thread-safe.
class ManualClock final : public Clock {
 public:
  ManualClock() : ns_(std::chrono::steady_clock::now().time_since_epoch().count()) {}
  time_point now() const override { return time_point(time_point::duration(ns_.load())); }
  void advance(double seconds) {
    ns_ += std::chrono::duration_cast<time_point::duration>(std::chrono::duration<double>(seconds)).count();
  }

 private:
  std::atomic<time_point::rep> ns_;
};

// Microseconds since the Unix epoch (Chrome trace timestamps).
inline double wall_us() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

// Seconds from `a` to `b`.
inline double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Seconds from `t` to now on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

inline const Clock& Clock::steady() {
  struct Steady final : Clock {
    time_point now() const override { return std::chrono::steady_clock::now(); }
  };
  static const Steady kSteady;
  return kSteady;
}

}  // namespace tiller
