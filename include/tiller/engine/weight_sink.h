// Where a weight sync delivers into an engine. The engine knows nothing of how the bytes travel:
// tiller::sync::WeightReceiver (sync/weight_sync.h) implements this over the sync communicator,
// tiller::sync::PushReceiver (sync/weight_push.h) over chunks the actor pushes to the engine's
// service (delta sync), and the engine calls receive() on every TP rank, on the thread that drives
// the engine, while no step is in flight.
#pragma once

#include <cstdint>
#include <string>

namespace tiller::engine {

// One pushed piece of a sync bucket (the PushWeights RPC; docs/sync.md, "Delta sync"): bytes
// [offset, offset + bytes) of bucket `bucket`, encoded by sync/delta_codec.h against the engine's
// copy (form 1 xor, 2 sparse) or in full (0).
struct WeightChunk {
  uint64_t version = 0;
  uint64_t plan_id = 0;
  int sender = 0;
  int bucket = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  int form = 0;
  uint64_t base_hash = 0;
  uint64_t hash = 0;
  uint64_t changed = 0;
  std::string payload;
};

class WeightSink {
 public:
  virtual ~WeightSink() = default;

  // Checks a serialized plan (from the control channel) against this rank's weights and keeps
  // it; returns its id. Throws ConfigError naming what does not fit; the previous plan stays then.
  virtual uint64_t install_plan(const std::string& plan) = 0;
  virtual uint64_t plan_id() const = 0;  // 0 until a plan is installed

  struct Result {
    bool complete = false;         // every bucket arrived and is in place
    bool weights_changed = false;  // bytes were written; false when it failed before any
    bool base_changed = false;     // ... to a parameter other than the LoRA adapters (an FP8
                                   // engine quantizes its base again after a complete sync)
    std::string error;             // why it failed, one line
  };
  // Receives one sync to `version` into this rank's weights, in place. Collective over the sync
  // communicator with every actor and engine rank. Failures are returned, not thrown.
  virtual Result receive(uint64_t version) = 0;

  // Delta sync (a sink that takes pushed chunks: sync::PushReceiver): applies one chunk of the sync
  // to `c.version` to this engine's copy of its bucket. Any thread; waits up to `wait_s` for
  // receive(c.version) to begin. Returns "" once applied, else why the chunk could not be applied
  // (the copy was not the delta's base, the result not the sender's): the sender pushes it again
  // in full. Throws InvalidRequest for a chunk of no sync in progress, of another plan or sender,
  // or outside its bucket. This default refuses every chunk: the sink takes its weights otherwise.
  virtual std::string take_chunk(const WeightChunk& c, double wait_s);
};

}  // namespace tiller::engine
