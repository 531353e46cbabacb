// The host-side machinery of the NCCL backend, free of CUDA and NCCL so that the CPU build
// compiles and unit-tests it: the launcher thread that makes the (possibly blocking) NCCL calls,
// the poll-with-deadline loop, the pool of reusable handles (CUDA events), and the watchdog's
// bookkeeping of ops in flight. Private to src/dist.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tiller/core/deadline.h"

namespace tiller::dist {

// A thread that runs jobs in order. Its state is shared with the thread, so a launcher stuck
// inside a call (NCCL blocked on a dead peer) can be abandoned without freeing what it uses.
class Launcher {
 public:
  // stuck_wait_s: how long destruction waits for the queued jobs before leaving the thread behind.
  explicit Launcher(double stuck_wait_s = 10);
  // Waits for the queued jobs (at most stuck_wait_s; then logs and leaves the thread), unless
  // abandoned: then it returns at once.
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  void post(std::function<void()> job);
  // The thread may be stuck inside a call: do not wait for it on destruction.
  void abandon() { abandoned_ = true; }
  // Threads that destruction left behind in this process, stuck or abandoned (logged each time).
  static int left_behind();

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::condition_variable exit_cv;
    std::deque<std::function<void()>> jobs;
    bool stop = false;
    bool exited = false;
  };
  static void run(State& s);
  std::shared_ptr<State> s_;
  double stuck_wait_s_;
  bool abandoned_ = false;
};

// Polls until poll() is true, calling on_expired() (which must throw) once `deadline` passes.
// Spins (yielding) for the first 2 ms, which covers most collectives, then sleeps in steps of at
// most 50 us: a completion is seen within ~50 us and a long wait burns no core.
template <typename Poll, typename OnExpired>
void poll_until(Poll&& poll, Deadline deadline, OnExpired&& on_expired) {
  const auto start = std::chrono::steady_clock::now();
  auto nap = std::chrono::microseconds(5);
  while (!poll()) {
    if (deadline.expired()) on_expired();
    if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(50));
    }
  }
}

// Handles that are costly to create (CUDA events): taken from the free list or created, given back
// for reuse; the free ones are destroyed with the pool. Thread-safe.
template <typename T>
class HandlePool {
 public:
  HandlePool(std::function<T()> create, std::function<void(T)> destroy)
      : create_(std::move(create)), destroy_(std::move(destroy)) {}
  ~HandlePool() {
    for (T h : free_) destroy_(h);
  }
  HandlePool(const HandlePool&) = delete;
  HandlePool& operator=(const HandlePool&) = delete;
  T take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        T h = free_.back();
        free_.pop_back();
        return h;
      }
    }
    return create_();
  }
  void give(T h) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(h);
  }
  // A handle that may still be in use elsewhere (the GPU) is destroyed, never reused.
  void discard(T h) { destroy_(h); }
  size_t free_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_.size();
  }

 private:
  std::function<T()> create_;
  std::function<void(T)> destroy_;
  mutable std::mutex mu_;
  std::vector<T> free_;
};

// One op's progress as the launcher, the waiters and the watchdog see it.
enum OpPhase : int { kQueued = 0, kLaunched = 1, kFailed = 2 };
struct OpTicket {
  std::string op;
  std::uint64_t seq = 0;
  Deadline deadline = Deadline::never();
  std::atomic<int> phase{kQueued};
  std::atomic<bool> complete{false};
  std::string error;  // set before phase becomes kFailed
  virtual ~OpTicket() = default;
};

// The watchdog's list of ops in flight. Thread-safe.
class OpWatch {
 public:
  void add(std::shared_ptr<OpTicket> t);
  // Drops the ops that are over: failed, complete, or launched and `done_on_device` says finished
  // (it marks them complete). Returns the first op past its deadline, if any, and then forgets
  // every op (the caller aborts the communicator, which fails them all).
  std::shared_ptr<OpTicket> sweep(const std::function<bool(OpTicket&)>& done_on_device);
  void clear();
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::list<std::shared_ptr<OpTicket>> pending_;
};

}  // namespace tiller::dist
