#include "dist/launcher.h"

#include "tiller/core/logging.h"

namespace tiller::dist {
namespace {
std::atomic<int> g_left_behind{0};
}  // namespace

Launcher::Launcher(double stuck_wait_s) : s_(std::make_shared<State>()), stuck_wait_s_(stuck_wait_s) {
  auto s = s_;
  std::thread([s] { run(*s); }).detach();
}

Launcher::~Launcher() {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
  }
  s_->cv.notify_all();
  if (abandoned_) {
    ++g_left_behind;
    return;
  }
  // Wait for the queued jobs; a thread stuck inside a call is left behind.
  std::unique_lock<std::mutex> lock(s_->mu);
  if (!s_->exit_cv.wait_for(lock, std::chrono::duration<double>(stuck_wait_s_), [this] { return s_->exited; })) {
    ++g_left_behind;
    log::error("NCCL launcher thread is stuck inside NCCL; leaving it behind (the process should exit)");
  }
}

int Launcher::left_behind() { return g_left_behind.load(); }

void Launcher::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->jobs.push_back(std::move(job));
  }
  s_->cv.notify_one();
}

void Launcher::run(State& s) {
  std::unique_lock<std::mutex> lock(s.mu);
  while (true) {
    // Stay awake briefly after a job: collectives come in bursts (ZeRO-3 layers, benchmarks).
    if (s.jobs.empty() && !s.stop) {
      lock.unlock();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while (std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
        std::lock_guard<std::mutex> peek(s.mu);
        if (!s.jobs.empty() || s.stop) break;
      }
      lock.lock();
      s.cv.wait(lock, [&] { return !s.jobs.empty() || s.stop; });
    }
    if (s.jobs.empty() && s.stop) break;
    auto job = std::move(s.jobs.front());
    s.jobs.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
  s.exited = true;
  s.exit_cv.notify_all();
}

void OpWatch::add(std::shared_ptr<OpTicket> t) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(std::move(t));
}

std::shared_ptr<OpTicket> OpWatch::sweep(const std::function<bool(OpTicket&)>& done_on_device) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    OpTicket& t = **it;
    const int phase = t.phase.load();
    if (phase == kFailed || t.complete.load() || (phase == kLaunched && done_on_device(t))) {
      if (phase == kLaunched) t.complete = true;
      it = pending_.erase(it);
      continue;
    }
    if (t.deadline.expired()) {
      auto late = *it;
      pending_.clear();
      return late;
    }
    ++it;
  }
  return nullptr;
}

void OpWatch::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.clear();
}

size_t OpWatch::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

}  // namespace tiller::dist
