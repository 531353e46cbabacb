#include "tiller/core/signals.h"

#include <algorithm>
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

char g_label[128] = {};

}  // namespace

void set_process_label(const std::string& label) {
  const size_t n = std::min(label.size(), sizeof(g_label) - 1);
  for (size_t i = 0; i < n; ++i) g_label[i] = label[i];
  g_label[n] = '\0';
}

const char* process_label() { return g_label; }

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
