// SIGINT and SIGTERM as requests to stop cleanly: blocked in every thread and taken by one
// watcher thread, which calls back (the controller finishes its step and saves; an engine stops
// serving). Block them first thing in main, before MPI or anything else starts a thread: threads
// inherit the mask, and a thread that does not block them would take the default action (exit).
#pragma once

#include <atomic>
#include <functional>
#include <string>
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

// What this process is in the job, e.g. "rank 3 (engine0.tp0)", for the line a crash prints (so a
// rank that dies of a signal is named by its role, not only its pid). Set once the rank plan is
// known; read from a signal handler: a fixed buffer, no allocation. "" until set.
void set_process_label(const std::string& label);
const char* process_label();

}  // namespace tiller
