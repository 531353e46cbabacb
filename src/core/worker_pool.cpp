#include "core/worker_pool.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller {

struct WorkerPool::State {
  struct Task {
    std::function<void()> run;
    bool keep = false;
  };
  std::string name;
  mutable std::mutex mu;
  std::condition_variable cv;    // workers: a task is queued, or stopping
  std::condition_variable idle;  // shutdown: a task ended
  std::deque<Task> queue;
  size_t running = 0;
  bool stopping = false;

  void work() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) return;
      Task t = std::move(queue.front());
      queue.pop_front();
      ++running;
      lock.unlock();
      try {
        t.run();
      } catch (const std::exception& e) {
        log::warn("{}: a task failed: {}", name, e.what());
      }
      t.run = nullptr;  // its captures go before the count says it ended
      lock.lock();
      --running;
      idle.notify_all();
    }
  }

  void drop_unkept() {  // under mu
    std::deque<Task> kept;
    for (auto& t : queue)
      if (t.keep) kept.push_back(std::move(t));
    queue = std::move(kept);
  }
};

WorkerPool::WorkerPool(int threads, std::string name, const std::string& what) : state_(std::make_shared<State>()) {
  if (threads < 1 || threads > kMaxThreads)
    throw ConfigError(fmt::format("{} = {}: allowed 1 to {}", what, threads, kMaxThreads));
  state_->name = std::move(name);
  for (int i = 0; i < threads; ++i) std::thread([s = state_] { s->work(); }).detach();
}

WorkerPool::~WorkerPool() { shutdown(0); }

void WorkerPool::submit(std::function<void()> task, bool keep) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->stopping) return;
    state_->queue.push_back({std::move(task), keep});
  }
  state_->cv.notify_one();
}

void WorkerPool::drop_queued() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->drop_unkept();
}

size_t WorkerPool::busy() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->queue.size() + state_->running;
}

bool WorkerPool::shutdown(double grace_seconds) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.stopping) return true;
  s.drop_unkept();
  bool drained = true;
  if (grace_seconds > 0) {
    drained = s.idle.wait_for(lock, std::chrono::duration<double>(grace_seconds),
                              [&] { return s.queue.empty() && s.running == 0; });
    if (!drained)
      log::warn("{}: {} call(s) still running and {} queued {} s after shutdown began; left behind (each ends at "
                "its deadline)",
                s.name, s.running, s.queue.size(), grace_seconds);
  }
  s.stopping = true;
  s.queue.clear();
  s.cv.notify_all();
  return drained;
}

}  // namespace tiller
