#include "rollout/engine_pool.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::rollout {

EnginePool::EnginePool(std::vector<std::string> addresses, const std::string& token, double rpc_timeout_s)
    : addresses_(std::move(addresses)) {
  for (const auto& a : addresses_) {
    engine::ClientOptions o;
    o.address = a;
    o.token = token;
    o.timeout_seconds = rpc_timeout_s;
    clients_.push_back(std::make_unique<engine::EngineClient>(o));
  }
  in_flight_.assign(addresses_.size(), 0);
}

EnginePool::~EnginePool() {
  // Only on a failure path are streams still open here, and the process is about to exit: a
  // reader may be blocked inside its session, so neither is destroyed under it.
  for (auto& t : readers_)
    if (t.joinable()) t.detach();
  for (auto& s : sessions_) (void)s.release();
}

void EnginePool::begin(Deadline deadline) {
  TILLER_CHECK(sessions_.empty(), "EnginePool::begin: the previous step's streams are still open");
  for (size_t i = 0; i < clients_.size(); ++i) {
    sessions_.push_back(clients_[i]->open_session(deadline));
    engine::GenerateSession* s = sessions_.back().get();
    readers_.emplace_back([this, s, i, deadline] {
      Completion c;
      c.engine = static_cast<int>(i);
      try {
        while (s->next(c.result, deadline)) {
          std::lock_guard<std::mutex> lock(mu_);
          queue_.push_back(c);
          cv_.notify_one();
        }
        return;
      } catch (const std::exception& e) {
        c.failure = fmt::format("engine {} ({}): {}", i, addresses_[i], e.what());
      }
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(c);
      cv_.notify_one();
    });
  }
}

int EnginePool::dispatch(const engine::Request& r, uint64_t min_weight_version) {
  const size_t i = static_cast<size_t>(std::min_element(in_flight_.begin(), in_flight_.end()) - in_flight_.begin());
  sessions_.at(i)->send(r, min_weight_version);
  in_flight_[i] += r.n;
  return static_cast<int>(i);
}

int64_t EnginePool::total_in_flight() const {
  int64_t n = 0;
  for (int64_t v : in_flight_) n += v;
  return n;
}

bool EnginePool::pop(Completion& out, int wait_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), [this] { return !queue_.empty(); })) return false;
  out = std::move(queue_.front());
  queue_.pop_front();
  if (out.failure.empty() && out.result.error_code == 0) --in_flight_[static_cast<size_t>(out.engine)];
  return true;
}

void EnginePool::end() {
  for (auto& s : sessions_) s->close_sends();
  for (auto& t : readers_) t.join();
  readers_.clear();
  sessions_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  queue_.clear();
}

}  // namespace tiller::rollout
