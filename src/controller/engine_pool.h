// The engines of `tiller train` over gRPC (private to src/controller): one client per engine, one
// Generate stream per engine for the whole run, and a single queue that every stream's reader
// thread feeds, so the controller waits on completions from all engines at once.
//
// Threading: the controller's thread calls everything; the reader threads only push to the queue.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "controller/engine_set.h"

namespace tiller::controller {

class EnginePool final : public EngineSet {
 public:
  // `addresses[i]` is engine i's host:port; each call but the streams has `rpc_timeout_s`.
  // `tls`: dial the engines over TLS when tls.ca is set. `elastic`: standalone engines, which the
  // job can lose (retire) and gain (add_engine).
  EnginePool(std::vector<std::string> addresses, const std::string& token, double rpc_timeout_s,
             const TlsFiles& tls = {}, bool elastic = false);
  ~EnginePool() override;

  size_t size() const override { return clients_.size(); }
  std::string name(size_t i) const override;
  uint64_t install_sync_plan(const std::string& plan_json) override;
  size_t add_engine(const std::string& address) override;
  bool retire(size_t i, const std::string& why) override;
  bool retired(size_t i) const override { return retired_.at(i); }
  bool elastic() const override { return elastic_; }
  const std::string& address(size_t i) const { return addresses_.at(i); }
  void open() override;
  void submit(size_t i, const engine::Request& r, uint64_t min_weight_version) override;
  void abort(size_t i, uint64_t request_id) override;
  bool next(Completion& out, int wait_ms) override;
  void begin_update(uint64_t version, uint64_t plan_id) override;
  void end_update(uint64_t version, double timeout_s) override;
  std::vector<engine::ServerMemory> sleep(int level) override;
  std::vector<engine::ServerMemory> wake(bool weights, bool cache) override;
  void release_session(size_t i, engine::SessionKey key) override;
  std::vector<engine::EngineStats> stats() override;
  void close() override;

 private:
  void open_stream(size_t i);

  std::vector<std::string> addresses_;
  std::string token_;
  TlsFiles tls_;
  std::string plan_json_;  // installed on every engine, and on those that join
  bool opened_ = false;
  bool elastic_ = false;
  std::vector<bool> retired_;
  std::vector<engine::EngineStats> last_stats_;  // a retired engine's counters stay as they were
  // A call to engine i failed: retire it when the set is elastic (logged), else throw `what`.
  void failed(size_t i, const std::string& what);
  std::vector<std::unique_ptr<engine::EngineClient>> clients_;
  std::vector<std::unique_ptr<engine::GenerateSession>> sessions_;
  std::vector<std::thread> readers_;
  // What the reader threads share with the pool. Owned jointly: on a failure path the pool is
  // destroyed with its readers detached (one may be blocked in its stream), and they must not
  // touch freed memory when their stream ends later.
  struct Inbox {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Completion> queue;
    size_t ended = 0;  // streams whose reader has returned
    bool closing = false;
  };
  std::shared_ptr<Inbox> inbox_ = std::make_shared<Inbox>();
  double rpc_timeout_s_;
};

}  // namespace tiller::controller
