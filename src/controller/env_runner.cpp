#include "controller/env_runner.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::rollout {
namespace {

constexpr int kMaxThreads = 4096;
constexpr double kShutdownGraceSeconds = 5;

}  // namespace

struct EnvRunner::State {
  struct Call {
    enum Kind { kStart, kStep, kClose } kind = kStart;
    uint64_t key = 0;
    env::EpisodeStart episode;
    std::string session;
    env::Action action;
  };
  std::shared_ptr<env::Environment> env;
  double timeout_s = 60;
  mutable std::mutex mu;
  std::condition_variable cv;     // workers: a call is queued, or stopping
  std::condition_variable idle;   // the destructor: a worker finished
  std::deque<Call> queue;
  std::vector<Result> results;
  size_t running = 0;
  bool stopping = false;

  void work() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) break;
      Call c = std::move(queue.front());
      queue.pop_front();
      ++running;
      lock.unlock();
      Result r = run(c);
      lock.lock();
      --running;
      if (c.kind != Call::kClose) results.push_back(std::move(r));
      idle.notify_all();
    }
  }

  Result run(const Call& c) {
    Result r;
    r.key = c.key;
    r.start = c.kind == Call::kStart;
    const auto t0 = std::chrono::steady_clock::now();
    const Deadline deadline = Deadline::after_seconds(timeout_s);
    try {
      switch (c.kind) {
        case Call::kStart: r.observation = env->start(c.episode, deadline); break;
        case Call::kStep: {
          env::StepResult s = env->step(c.session, c.action, deadline);
          r.observation = std::move(s.observation);
          r.reward = s.reward;
          r.done = s.done;
          break;
        }
        case Call::kClose: env->close(c.session, deadline); break;
      }
    } catch (const std::exception& e) {
      r.error = e.what();
      if (c.kind == Call::kClose)
        log::warn("{}: closing session {} failed (its sample is complete; the job goes on): {}", env->name(),
                  c.session, e.what());
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
};

EnvRunner::EnvRunner(std::shared_ptr<env::Environment> env, int threads, double timeout_s)
    : env_(std::move(env)), state_(std::make_shared<State>()) {
  TILLER_CHECK(env_ != nullptr, "EnvRunner needs an environment");
  if (threads < 1 || threads > kMaxThreads)
    throw ConfigError(fmt::format("env.concurrency = {}: allowed 1 to {}", threads, kMaxThreads));
  state_->env = env_;
  state_->timeout_s = timeout_s;
  // Detached, sharing the state: a call blocked past the shutdown grace cannot touch freed memory.
  for (int i = 0; i < threads; ++i) std::thread([s = state_] { s->work(); }).detach();
}

EnvRunner::~EnvRunner() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  // Queued closes still go out (best effort within the grace); starts and steps are moot.
  std::deque<State::Call> closes;
  for (auto& c : s.queue)
    if (c.kind == State::Call::kClose) closes.push_back(std::move(c));
  s.queue = std::move(closes);
  const auto grace = std::chrono::duration<double>(kShutdownGraceSeconds);
  const bool drained = s.idle.wait_for(lock, grace, [&] { return s.queue.empty() && s.running == 0; });
  s.stopping = true;
  s.cv.notify_all();
  if (!drained)
    log::warn("{}: {} call(s) still running and {} queued {} s after shutdown began; left behind (each ends at "
              "its deadline)",
              env_->name(), s.running, s.queue.size(), kShutdownGraceSeconds);
}

void EnvRunner::start(uint64_t key, env::EpisodeStart episode) {
  State::Call c;
  c.kind = State::Call::kStart;
  c.key = key;
  c.episode = std::move(episode);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(std::move(c));
  }
  state_->cv.notify_one();
}

void EnvRunner::step(uint64_t key, const std::string& session_id, env::Action action) {
  State::Call c;
  c.kind = State::Call::kStep;
  c.key = key;
  c.session = session_id;
  c.action = std::move(action);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(std::move(c));
  }
  state_->cv.notify_one();
}

void EnvRunner::close(const std::string& session_id) {
  State::Call c;
  c.kind = State::Call::kClose;
  c.session = session_id;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(std::move(c));
  }
  state_->cv.notify_one();
}

std::vector<EnvRunner::Result> EnvRunner::poll() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<Result> out = std::move(state_->results);
  state_->results.clear();
  return out;
}

size_t EnvRunner::busy() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->queue.size() + state_->running;
}

}  // namespace tiller::rollout
