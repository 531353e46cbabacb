// SIGINT and SIGTERM as requests to stop cleanly: blocked in every thread and taken by one
// watcher thread, which calls back (the controller finishes its step and saves; an engine stops
// serving). Block them first thing in main, before MPI or anything else starts a thread: threads
// inherit the mask, and a thread that does not block them would take the default action (exit).
#pragma once

#include <atomic>
#include <functional>
#include <thread>

namespace tiller {

// Blocks SIGINT and SIGTERM in the calling thread (and so in the threads it starts afterwards).
void block_stop_signals();

// A thread that calls `on_signal` for every SIGINT/SIGTERM that arrives while it lives (checked
// every 200 ms). Call block_stop_signals() before. The callback runs on the watcher's thread.
class StopSignalWatcher {
 public:
  explicit StopSignalWatcher(std::function<void()> on_signal);
  ~StopSignalWatcher();  // stops and joins the thread
  StopSignalWatcher(const StopSignalWatcher&) = delete;
  StopSignalWatcher& operator=(const StopSignalWatcher&) = delete;

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace tiller
