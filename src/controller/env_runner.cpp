#include "controller/env_runner.h"

#include <chrono>
#include <mutex>
#include <unordered_map>

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
  // The sessions with a Start or Step queued or running (one at a time: the loop waits for each
  // answer): a Close never runs before or beside its session's call. A Close wanted while the call
  // is queued makes that call skip the environment (a skipped Start opens nothing, so nothing is
  // closed); while it runs, the Close follows it, from the worker that ends it.
  struct Pending {
    bool step = false;     // a Step: the session is open on the environment
    bool running = false;  // a worker has begun it
    bool close = false;    // a Close waits for it
  };
  std::unordered_map<std::string, Pending> pending;
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

  static void submit_close(const std::shared_ptr<State>& s, const std::string& session) {
    Call c;
    c.kind = Call::kClose;
    c.session = session;
    submit(s, std::move(c));
  }

  // Closes are kept through the shutdown (best effort within the grace); starts and steps are moot.
  static void submit(const std::shared_ptr<State>& s, Call c) {
    const bool close = c.kind == Call::kClose;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (close) {
        if (auto p = s->pending.find(c.session); p != s->pending.end()) {
          p->second.close = true;
          return;
        }
      } else {
        TILLER_CHECK(!s->pending.count(session_of(c)), "environment session {}: a call while its last is in flight",
                     session_of(c));
        s->pending[session_of(c)] = Pending{c.kind == Call::kStep, false, false};
      }
    }
    // The task holds the state, not the runner: a call left behind at shutdown touches no freed memory.
    s->pool->submit(
        [w = std::weak_ptr<State>(s), c = std::move(c)] {
          std::shared_ptr<State> st = w.lock();
          if (!st) return;
          if (c.kind == Call::kClose) {
            st->run(c);
            return;
          }
          const std::string& session = session_of(c);
          bool skip = false, close_now = false;
          {
            std::lock_guard<std::mutex> lock(st->mu);
            auto p = st->pending.find(session);
            if (p == st->pending.end() || p->second.close) {  // closed while it waited: the group is gone
              skip = true;
              close_now = p != st->pending.end() && p->second.step;
              if (p != st->pending.end()) st->pending.erase(p);
            } else {
              p->second.running = true;
            }
          }
          if (!skip) {
            Result r = st->run(c);
            std::lock_guard<std::mutex> lock(st->mu);
            st->results.push_back(std::move(r));
            if (auto p = st->pending.find(session); p != st->pending.end()) {
              close_now = p->second.close;
              st->pending.erase(p);
            }
          }
          if (close_now) submit_close(st, session);
        },
        close);
  }

  // Shutdown: the queued Steps of sessions whose Close waits are dropped unrun, so their Closes go
  // now (kept); a running call's Close follows it, within the grace.
  static void close_waiting(const std::shared_ptr<State>& s) {
    std::vector<std::string> now;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (auto p = s->pending.begin(); p != s->pending.end();) {
        if (p->second.close && !p->second.running) {
          if (p->second.step) now.push_back(p->first);
          p = s->pending.erase(p);
        } else {
          ++p;
        }
      }
    }
    for (const std::string& session : now) submit_close(s, session);
  }
};

EnvRunner::EnvRunner(std::shared_ptr<env::Environment> env, int threads, double timeout_s)
    : env_(std::move(env)), state_(std::make_shared<State>()) {
  TILLER_CHECK(env_ != nullptr, "EnvRunner needs an environment");
  state_->env = env_;
  state_->timeout_s = timeout_s;
  state_->pool = std::make_unique<WorkerPool>(threads, env_->name(), "env.concurrency");
}

EnvRunner::~EnvRunner() {
  State::close_waiting(state_);
  state_->pool->shutdown(kShutdownGraceSeconds);
}

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

void EnvRunner::close(const std::string& session_id) { State::submit_close(state_, session_id); }

std::vector<EnvRunner::Result> EnvRunner::poll() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<Result> out = std::move(state_->results);
  state_->results.clear();
  return out;
}

size_t EnvRunner::busy() const { return state_->pool->busy(); }

}  // namespace tiller::controller
