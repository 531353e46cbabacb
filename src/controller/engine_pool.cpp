#include "controller/engine_pool.h"

#include <chrono>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::controller {

EnginePool::EnginePool(std::vector<std::string> addresses, const std::string& token, double rpc_timeout_s,
                       const TlsFiles& tls, bool elastic)
    : token_(token), tls_(tls), elastic_(elastic), rpc_timeout_s_(rpc_timeout_s) {
  for (const auto& a : addresses) {
    addresses_.push_back(a);
    retired_.push_back(false);
    last_stats_.emplace_back();
    engine::ClientOptions o;
    o.address = a;
    o.token = token_;
    o.tls = tls_;
    o.timeout_seconds = rpc_timeout_s_;
    clients_.push_back(std::make_unique<engine::EngineClient>(o));
  }
}

size_t EnginePool::add_engine(const std::string& address) {
  engine::ClientOptions o;
  o.address = address;
  o.token = token_;
  o.tls = tls_;
  o.timeout_seconds = rpc_timeout_s_;
  auto client = std::make_unique<engine::EngineClient>(o);
  const size_t i = clients_.size();
  const std::string name = fmt::format("engine {} ({})", i, address);
  try {
    if (!plan_json_.empty()) client->install_sync_plan(plan_json_);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("{} cannot join: {}", name, e.what()));
  }
  addresses_.push_back(address);
  retired_.push_back(false);
  last_stats_.emplace_back();
  clients_.push_back(std::move(client));
  if (opened_) open_stream(i);
  return i;
}

bool EnginePool::retire(size_t i, const std::string& why) {
  if (!elastic_) return false;
  if (retired_.at(i)) return true;
  retired_[i] = true;
  log::warn("{} leaves the job: {}", name(i), why);
  if (i < sessions_.size()) sessions_[i]->cancel();  // its reader ends; its failure is ignored
  return true;
}

void EnginePool::failed(size_t i, const std::string& what) {
  if (!retire(i, what)) throw CommError(what);
}

EnginePool::~EnginePool() {
  // Only on a failure path are streams still open here, and the process is about to exit: a
  // reader may be blocked inside its session, so neither is destroyed under it.
  for (auto& t : readers_)
    if (t.joinable()) t.detach();
  for (auto& s : sessions_) (void)s.release();
}

std::string EnginePool::name(size_t i) const { return fmt::format("engine {} ({})", i, addresses_.at(i)); }

uint64_t EnginePool::install_sync_plan(const std::string& plan_json) {
  uint64_t id = 0;
  for (size_t i = 0; i < clients_.size(); ++i)
    if (!retired_[i]) id = clients_[i]->install_sync_plan(plan_json);
  plan_json_ = plan_json;
  return id;
}

void EnginePool::open() {
  TILLER_CHECK(!opened_, "EnginePool::open: the streams are already open");
  opened_ = true;
  for (size_t i = 0; i < clients_.size(); ++i) open_stream(i);
}

void EnginePool::open_stream(size_t i) {
  // The streams live for the run; progress is watched by the collector (timeouts.generate_s).
  sessions_.push_back(clients_[i]->open_session(Deadline::never()));
  engine::GenerateSession* s = sessions_.back().get();
  readers_.emplace_back([inbox = inbox_, s, i, name = name(i)] {
    Completion c;
    c.engine = static_cast<int>(i);
    try {
      while (s->next(c.result, Deadline::never())) {
        std::lock_guard<std::mutex> lock(inbox->mu);
        if (!inbox->closing) inbox->queue.push_back(std::move(c));
        inbox->cv.notify_all();
        c = Completion{};
        c.engine = static_cast<int>(i);
      }
    } catch (const std::exception& e) {
      c.failure = fmt::format("{}: {}", name, e.what());
    }
    std::lock_guard<std::mutex> lock(inbox->mu);
    ++inbox->ended;
    if (!inbox->closing && !c.failure.empty()) inbox->queue.push_back(std::move(c));
    inbox->cv.notify_all();
  });
}

void EnginePool::submit(size_t i, const engine::Request& r, uint64_t min_weight_version) {
  TILLER_CHECK(!retired_.at(i), "a request to {}, which left the job", name(i));
  sessions_.at(i)->send(r, min_weight_version);
}

void EnginePool::abort(size_t i, uint64_t request_id) {
  if (!retired_.at(i)) sessions_.at(i)->abort(request_id);
}

bool EnginePool::next(Completion& out, int wait_ms) {
  Inbox& in = *inbox_;
  std::unique_lock<std::mutex> lock(in.mu);
  for (;;) {
    if (!in.cv.wait_for(lock, std::chrono::milliseconds(wait_ms), [&] { return !in.queue.empty(); })) return false;
    out = std::move(in.queue.front());
    in.queue.pop_front();
    // A retired engine's stream was cancelled: its end is no news, and what it sent before is
    // moot (its requests went to the others whole, which send every sample again).
    if (retired_.at(static_cast<size_t>(out.engine))) continue;
    return true;
  }
}

void EnginePool::begin_update(uint64_t version, uint64_t plan_id) {
  for (size_t i = 0; i < clients_.size(); ++i) {
    if (retired_[i]) continue;
    try {
      clients_[i]->begin_weight_update(version, false, plan_id);
    } catch (const std::exception& e) {
      failed(i, fmt::format("weight sync {}: {} refused to begin: {}", version, name(i), e.what()));
    }
  }
}

void EnginePool::end_update(uint64_t version, double timeout_s) {
  for (size_t i = 0; i < clients_.size(); ++i) {
    if (retired_[i]) continue;
    try {
      clients_[i]->end_weight_update(version, timeout_s);
    } catch (const std::exception& e) {
      failed(i, fmt::format("weight sync {} to {} failed: {}", version, name(i), e.what()));
    }
  }
}

std::vector<engine::ServerMemory> EnginePool::sleep(int level) {
  std::vector<engine::ServerMemory> out;
  for (size_t i = 0; i < clients_.size(); ++i) {
    if (retired_[i]) continue;
    try {
      out.push_back(clients_[i]->sleep(level));
    } catch (const std::exception& e) {
      failed(i, fmt::format("{} failed to sleep (level {}): {}", name(i), level, e.what()));
    }
  }
  return out;
}

std::vector<engine::ServerMemory> EnginePool::wake(bool weights, bool cache) {
  std::vector<engine::ServerMemory> out;
  for (size_t i = 0; i < clients_.size(); ++i) {
    if (retired_[i]) continue;
    try {
      out.push_back(clients_[i]->wake(weights, cache));
    } catch (const std::exception& e) {
      failed(i, fmt::format("{} failed to wake ({}): {}", name(i), cache ? "its KV cache" : "its weights", e.what()));
    }
  }
  return out;
}

void EnginePool::release_session(size_t i, engine::SessionKey key) {
  if (!retired_.at(i)) sessions_.at(i)->release_session(key);
}

std::vector<engine::EngineStats> EnginePool::stats() {
  for (size_t i = 0; i < clients_.size(); ++i) {
    if (retired_[i]) continue;
    try {
      last_stats_[i] = clients_[i]->stats().engine;
    } catch (const std::exception& e) {
      failed(i, fmt::format("{} failed to report its stats: {}", name(i), e.what()));
    }
  }
  return last_stats_;
}

void EnginePool::close() {
  Inbox& in = *inbox_;
  {
    std::lock_guard<std::mutex> lock(in.mu);
    in.closing = true;
  }
  // No more requests: each server ends its stream once the requests on it have answered (the
  // caller aborted what it no longer wants). A stream that has not ended by the deadline is
  // cancelled, which makes its server abort whatever is left.
  for (auto& s : sessions_) s->close_sends();
  const Deadline deadline = Deadline::after_seconds(rpc_timeout_s_);
  {
    std::unique_lock<std::mutex> lock(in.mu);
    in.cv.wait_until(lock, deadline.at(), [&] { return in.ended == readers_.size(); });
  }
  bool all_ended = false;
  {
    std::lock_guard<std::mutex> lock(in.mu);
    all_ended = in.ended == readers_.size();
  }
  if (!all_ended)
    for (auto& s : sessions_) s->cancel();
  for (auto& t : readers_) t.join();
  readers_.clear();
  sessions_.clear();
  std::lock_guard<std::mutex> lock(in.mu);
  in.queue.clear();
}

}  // namespace tiller::controller
