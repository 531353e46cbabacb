// Worker threads for clients whose calls block: an environment's, a reward service's, an agent
// harness's. Tasks run in the order queued, on `threads` detached threads that share the pool's
// state, so a task still blocked when the pool goes is left behind without touching freed memory
// (a task must likewise hold what it uses by shared_ptr, never by a reference to its owner).
// Thread-safe. Private to src.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace tiller {

class WorkerPool {
 public:
  static constexpr int kMaxThreads = 4096;

  // `threads` in [1, kMaxThreads] (ConfigError naming `what`, e.g. "env.concurrency", otherwise);
  // `name` says whose pool it is in the shutdown's log line.
  WorkerPool(int threads, std::string name, const std::string& what);
  // shutdown(0): queued tasks are dropped, running ones left to end on their own.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task`; `keep`: shutdown still runs it (a session's close) rather than dropping it.
  // An exception a task throws is logged and dropped: tasks report their own failures.
  void submit(std::function<void()> task, bool keep = false);
  // Drops the queued tasks that are not kept.
  void drop_queued();
  // Tasks queued or running.
  size_t busy() const;
  // Drops the queued tasks not kept, waits up to `grace_seconds` for the kept ones and the running
  // ones to end, then stops the threads (each after its task). False, with a warning naming the
  // pool and what is left, when the grace ran out first (0: no wait, no warning).
  bool shutdown(double grace_seconds);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace tiller
