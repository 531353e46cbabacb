// The inference engines as the controller sees them (private to src/controller): requests in,
// completions out, and the weight updates. EnginePool (engine_pool.h) is the real one, over
// gRPC; SyntheticEngines (synthetic.h) stands in for it in tests and `tiller bench controller`.
//
// Threading: every method belongs to the controller's thread; implementations may produce
// completions on threads of their own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/engine/server.h"

namespace tiller::controller {

struct Completion {
  int engine = 0;
  engine::ClientResult result;  // a sample (error_code 0) or a request the engine refused
  std::string failure;          // the engine's stream failed (it died or timed out): the job cannot go on
};

class EngineSet {
 public:
  virtual ~EngineSet() = default;
  virtual size_t size() const = 0;
  // "engine 1 (node3:50052)": for messages.
  virtual std::string name(size_t i) const = 0;
  // Checks the sync plan against every engine and installs it; returns its id (0: the engines
  // take no sync, as synthetic ones). InvalidRequest names what does not fit.
  virtual uint64_t install_sync_plan(const std::string& plan_json) = 0;
  // Standalone engines (engines.rendezvous_dir): takes the engine serving at `address` into the
  // set (the sync plan installed on it, its stream opened if the others' are) and returns its
  // index. Errors name the engine. A set that cannot grow refuses.
  virtual size_t add_engine(const std::string& address) {
    throw ConfigError(fmt::format("engine {}: this job's engines are fixed at its start", address));
  }
  // Standalone engines: takes engine i out of the job for good (it died, stalled, failed a sync):
  // its stream is cancelled, no call reaches it again and next() gives nothing more of it (not
  // even what it sent before); size() and the indexes stay. False when
  // this set cannot lose an engine (the job's own engine ranks: the job cannot go on without one).
  virtual bool retire(size_t i, const std::string& why) {
    (void)i;
    (void)why;
    return false;
  }
  virtual bool elastic() const { return false; }  // retire() takes engines out
  virtual bool retired(size_t i) const {
    (void)i;
    return false;
  }
  size_t live_count() const {
    size_t n = 0;
    for (size_t i = 0; i < size(); ++i) n += retired(i) ? 0 : 1;
    return n;
  }
  // Opens the request streams, once; they stay open until close().
  virtual void open() = 0;
  // Sends `r` (r.n samples) to engine `i`; it refuses it unless its weights are at least
  // `min_weight_version` (the refusal comes back as a completion).
  virtual void submit(size_t i, const engine::Request& r, uint64_t min_weight_version) = 0;
  // Drops a request on engine i: its unfinished samples come back with finish_reason "abort".
  virtual void abort(size_t i, uint64_t request_id) = 0;
  // The next completion from any engine, waiting at most `wait_ms`; false when none came.
  virtual bool next(Completion& out, int wait_ms) = 0;
  // The weight update of every engine (docs/sync.md): begin pauses each after its current step
  // and, with a plan id, makes it receive the sync; end waits for the receive (until timeout_s)
  // and resumes it at `version`. Samples in flight continue with the new weights. Retired engines
  // are skipped; a set that can lose engines retires one that fails here instead of throwing.
  virtual void begin_update(uint64_t version, uint64_t plan_id) = 0;
  virtual void end_update(uint64_t version, double timeout_s) = 0;
  // The hybrid engine's phases: every engine sleeps at `level` (1 or 2) or wakes (the weights'
  // memory, the KV cache); returns each engine's memory (its leader rank's) afterwards.
  virtual std::vector<engine::ServerMemory> sleep(int level) = 0;
  virtual std::vector<engine::ServerMemory> wake(bool weights, bool cache) = 0;
  // Frees a parked multi-turn session on engine i (its episode ended); a session that is gone is fine.
  virtual void release_session(size_t i, engine::SessionKey key) = 0;
  // Each engine's counters since it started (seconds in steps for idle time, prefill and session
  // counters for multi-turn metrics); empty when unknown.
  virtual std::vector<engine::EngineStats> stats() = 0;
  // Ends the streams; requests still in flight are aborted.
  virtual void close() = 0;
};

}  // namespace tiller::controller
