#include "controller/agent_sessions.h"

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "core/worker_pool.h"
#include "tiller/core/error.h"

namespace tiller::controller {

void answer(StreamBox& box, engine::ClientResult r) {
  {
    std::lock_guard<std::mutex> lock(box.mu);
    box.results.push_back(std::move(r));
    --box.pending;
  }
  box.cv.notify_all();
}

void refuse(StreamBox& box, uint64_t endpoint_id, int code, std::string message) {
  engine::ClientResult r;
  r.sample.request_id = endpoint_id;
  r.error_code = code;
  r.error = std::move(message);
  answer(box, std::move(r));
}

namespace {

using Clock = std::chrono::steady_clock;

class AgentStream final : public engine::OpenAiStream {
 public:
  AgentStream(std::shared_ptr<AgentShared> shared, std::string route)
      : shared_(std::move(shared)), route_(std::move(route)), box_(std::make_shared<StreamBox>()) {}
  ~AgentStream() override {
    bool live = false;
    {
      std::lock_guard<std::mutex> lock(box_->mu);
      live = box_->pending > 0;
    }
    if (live) push({true, route_, box_, {}, 0});
  }
  void send(const engine::Request& r) override {
    {
      std::lock_guard<std::mutex> lock(box_->mu);
      ++box_->pending;
    }
    push({false, route_, box_, r, r.id});
  }
  void abort(uint64_t id) override { push({true, route_, box_, {}, id}); }
  bool next(engine::ClientResult& out, Deadline deadline) override {
    std::unique_lock<std::mutex> lock(box_->mu);
    for (;;) {
      if (!box_->results.empty()) {
        out = std::move(box_->results.front());
        box_->results.pop_front();
        return true;
      }
      if (box_->pending <= 0) return false;
      if (deadline.expired())
        throw TimeoutError(fmt::format("agent session {}: no answer from the policy within the request's deadline",
                                       route_));
      box_->cv.wait_for(lock, std::chrono::duration<double>(std::min(deadline.remaining_seconds(), 1.0)));
    }
  }

 private:
  void push(Inbound in) {
    std::unique_lock<std::mutex> lock(shared_->mu);
    if (!shared_->closed) {
      shared_->inbox.push_back(std::move(in));
      return;
    }
    lock.unlock();
    if (!in.abort) refuse(*in.box, in.endpoint_id, kUnavailable, "the agent sessions are closed (the run ended)");
  }
  std::shared_ptr<AgentShared> shared_;
  std::string route_;
  std::shared_ptr<StreamBox> box_;
};

class AgentBackend final : public engine::OpenAiBackend {
 public:
  explicit AgentBackend(std::shared_ptr<AgentShared> s) : shared_(std::move(s)) {}
  std::unique_ptr<engine::OpenAiStream> open(const std::string& route) override {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (route.empty() || shared_->routes.count(route) == 0) return nullptr;
    return std::make_unique<AgentStream>(shared_, route);
  }
  // Choices arrive whole: the loop records each request's sample when the engine ends it.
  bool streams_tokens() const override { return false; }

 private:
  std::shared_ptr<AgentShared> shared_;
};

}  // namespace

std::shared_ptr<engine::OpenAiBackend> agent_backend(std::shared_ptr<AgentShared> shared) {
  return std::make_shared<AgentBackend>(std::move(shared));
}

struct HarnessPool::State {
  std::shared_ptr<AgentHarness> harness;
  std::mutex mu;
  std::vector<Result> done;
  std::unique_ptr<WorkerPool> pool;
};

HarnessPool::HarnessPool(std::shared_ptr<AgentHarness> harness, int threads) : state_(std::make_shared<State>()) {
  state_->pool = std::make_unique<WorkerPool>(threads, "the agent harnesses", "agent.concurrency");
  state_->harness = std::move(harness);
}

// The pool drops what is queued; a harness still running ends at its deadline and its result,
// with nobody to take it, goes with the state.
HarnessPool::~HarnessPool() { state_->pool->shutdown(0); }

void HarnessPool::run(uint64_t key, AgentTask task, Deadline deadline) {
  // The task holds the state weakly: a harness left behind at shutdown touches no freed memory.
  state_->pool->submit([w = std::weak_ptr<State>(state_), key, task = std::move(task), deadline] {
    std::shared_ptr<State> s = w.lock();
    if (!s) return;
    Result r;
    r.key = key;
    const auto t0 = Clock::now();
    try {
      r.outcome = s->harness->run(task, deadline);
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::lock_guard<std::mutex> lock(s->mu);
    s->done.push_back(std::move(r));
  });
}

std::vector<HarnessPool::Result> HarnessPool::take() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<Result> out(std::make_move_iterator(state_->done.begin()), std::make_move_iterator(state_->done.end()));
  state_->done.clear();
  return out;
}

}  // namespace tiller::controller
