#include "tiller/core/signals.h"

#include <csignal>
#include <ctime>

namespace tiller {
namespace {

sigset_t stop_signals() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGINT);
  sigaddset(&s, SIGTERM);
  return s;
}

}  // namespace

void block_stop_signals() {
  const sigset_t s = stop_signals();
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
}

StopSignalWatcher::StopSignalWatcher(std::function<void()> on_signal) {
  thread_ = std::thread([this, on_signal = std::move(on_signal)] {
    const sigset_t s = stop_signals();
    const timespec tick{0, 200 * 1000 * 1000};
    while (!done_) {
      if (sigtimedwait(&s, nullptr, &tick) > 0) on_signal();
    }
  });
}

StopSignalWatcher::~StopSignalWatcher() {
  done_ = true;
  thread_.join();
}

}  // namespace tiller
