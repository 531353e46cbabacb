#include "controller/env_runner.h"

#include <chrono>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "core/worker_pool.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::controller {
namespace {

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
  std::mutex mu;
  std::vector<Result> results;
  // Per session, its Start or Step queued or running, and the sessions whose Close waits for it:
  // a Close never overtakes (or runs beside) its session's last call (a group dropped mid-call).
  std::unordered_map<std::string, int> active;
  std::unordered_set<std::string> close_after;
  std::unique_ptr<WorkerPool> pool;

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

  static const std::string& session_of(const Call& c) {
    return c.kind == Call::kStart ? c.episode.session_id : c.session;
  }

  // Closes are kept through the shutdown (best effort within the grace); starts and steps are moot.
  static void submit(const std::shared_ptr<State>& s, Call c) {
    const bool close = c.kind == Call::kClose;
    if (close) {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->active.count(c.session)) {  // after its call in flight, from the worker that ends it
        s->close_after.insert(c.session);
        return;
      }
    } else {
      std::lock_guard<std::mutex> lock(s->mu);
      ++s->active[session_of(c)];
    }
    // The task holds the state, not the runner: a call left behind at shutdown touches no freed memory.
    s->pool->submit(
        [w = std::weak_ptr<State>(s), c = std::move(c)] {
          std::shared_ptr<State> st = w.lock();
          if (!st) return;
          Result r = st->run(c);
          if (c.kind == Call::kClose) return;
          bool close_now = false;
          {
            std::lock_guard<std::mutex> lock(st->mu);
            st->results.push_back(std::move(r));
            auto a = st->active.find(session_of(c));
            if (a != st->active.end() && --a->second <= 0) {
              st->active.erase(a);
              close_now = st->close_after.erase(session_of(c)) > 0;
            }
          }
          if (close_now) {
            Call cl;
            cl.kind = Call::kClose;
            cl.session = session_of(c);
            submit(st, std::move(cl));
          }
        },
        close);
  }
};

EnvRunner::EnvRunner(std::shared_ptr<env::Environment> env, int threads, double timeout_s)
    : env_(std::move(env)), state_(std::make_shared<State>()) {
  TILLER_CHECK(env_ != nullptr, "EnvRunner needs an environment");
  state_->env = env_;
  state_->timeout_s = timeout_s;
  state_->pool = std::make_unique<WorkerPool>(threads, env_->name(), "env.concurrency");
}

EnvRunner::~EnvRunner() { state_->pool->shutdown(kShutdownGraceSeconds); }

void EnvRunner::start(uint64_t key, env::EpisodeStart episode) {
  State::Call c;
  c.kind = State::Call::kStart;
  c.key = key;
  c.episode = std::move(episode);
  State::submit(state_, std::move(c));
}

void EnvRunner::step(uint64_t key, const std::string& session_id, env::Action action) {
  State::Call c;
  c.kind = State::Call::kStep;
  c.key = key;
  c.session = session_id;
  c.action = std::move(action);
  State::submit(state_, std::move(c));
}

void EnvRunner::close(const std::string& session_id) {
  State::Call c;
  c.kind = State::Call::kClose;
  c.session = session_id;
  State::submit(state_, std::move(c));
}

std::vector<EnvRunner::Result> EnvRunner::poll() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<Result> out = std::move(state_->results);
  state_->results.clear();
  return out;
}

size_t EnvRunner::busy() const { return state_->pool->busy(); }

}  // namespace tiller::controller
