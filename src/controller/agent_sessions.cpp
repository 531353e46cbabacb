#include "controller/agent_sessions.h"

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::rollout {

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
  struct Job {
    uint64_t key = 0;
    AgentTask task;
    Deadline deadline = Deadline::never();
  };
  std::shared_ptr<AgentHarness> harness;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job> queue;
  std::vector<Result> done;
  bool stop = false;

  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (stop) return;
        job = std::move(queue.front());
        queue.pop_front();
      }
      Result r;
      r.key = job.key;
      const auto t0 = Clock::now();
      try {
        r.outcome = harness->run(job.task, job.deadline);
      } catch (const std::exception& e) {
        r.error = e.what();
      }
      r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      std::lock_guard<std::mutex> lock(mu);
      if (stop) return;
      done.push_back(std::move(r));
    }
  }
};

HarnessPool::HarnessPool(std::shared_ptr<AgentHarness> harness, int threads) : state_(std::make_shared<State>()) {
  state_->harness = std::move(harness);
  for (int i = 0; i < threads; ++i) std::thread([s = state_] { s->work(); }).detach();
}

HarnessPool::~HarnessPool() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
    state_->queue.clear();
  }
  state_->cv.notify_all();
}

void HarnessPool::run(uint64_t key, AgentTask task, Deadline deadline) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back({key, std::move(task), deadline});
  }
  state_->cv.notify_one();
}

std::vector<HarnessPool::Result> HarnessPool::take() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<Result> out(std::make_move_iterator(state_->done.begin()), std::make_move_iterator(state_->done.end()));
  state_->done.clear();
  return out;
}

}  // namespace tiller::rollout
