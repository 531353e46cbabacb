// Where a weight sync delivers into an engine. The engine knows nothing of how the bytes travel:
// tiller::sync::WeightReceiver (sync/weight_sync.h) implements this over the sync communicator,
// and the engine calls it on every TP rank, on the thread that drives the engine, while no step
// is in flight.
#pragma once

#include <cstdint>
#include <string>

namespace tiller::engine {

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
};

}  // namespace tiller::engine
