// Delta weight sync over the engine's service (docs/sync.md, "Delta sync"): for engines that are
// not ranks of the actor's job (a standalone `tiller engine` on another node or started later),
// each actor rank pushes its own buckets of the bucket plan to every engine over gRPC
// (EngineClient::push_weights), as chunks that carry only what changed since the engine's copy.
//
// One sync to version v, driven by whoever drives the engines (the controller, a test, `tiller
// bench sync --push`):
//   every engine   BeginWeightUpdate(v, plan id)   the engine's loop enters PushReceiver::receive(v)
//   every actor    WeightPusher::push(v, engines)  its buckets, chunk by chunk, to every engine
//   every engine   EndWeightUpdate(v)              complete when every bucket arrived and is in place
//
// The sender keeps a copy of its buckets as last pushed (the base); the engine keeps a copy of
// every bucket as last applied (the host memory of the model's wire bytes), which it places into
// its weights. A chunk is encoded once (sync/delta_codec.h: the XOR or the sparse list of changed
// elements against the base, zstd, the XXH3 hashes of base and result) and sent to every engine;
// an engine whose copy is not that base (it joined late, missed a sync, was restarted), or that
// received damaged bytes, answers with the chunk, and the sender pushes it again in full. The
// hashes make every sync exact: an engine ends with the sender's bytes or the sync fails.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tiller/engine/server.h"
#include "tiller/engine/weight_sink.h"
#include "tiller/sync/bucket_plan.h"

namespace tiller {
struct JobConfig;
}
namespace tiller::dist {
class Communicator;
}
namespace tiller::zero {
class ShardedModel;
}
namespace tiller::engine {
class Engine;
}  // namespace tiller::engine

namespace tiller::sync {

// Chunks are at most this (a gRPC message holds one, with its compression's worst case).
constexpr uint64_t kMaxPushChunkBytes = uint64_t{32} << 20;

struct PushOptions {
  double timeout_s = 300;             // the whole push, resends included
  uint64_t chunk_bytes = 8 << 20;     // [64 KiB, kMaxPushChunkBytes], a multiple of the wire element
  int threads = 0;                    // encoding threads, each with its own stream to every engine;
                                      // 0: the hardware's, at most 16
  int zstd_level = 1;                 // 1 to 19
  bool delta = true;                  // false: every chunk in full (the first push always is)
  // Fault injection for tests: called with each chunk for engine `engine` before it is written
  // (not for resends); it may damage the chunk.
  std::function<void(size_t engine, engine::WeightChunk&)> on_chunk;
};

struct PushTarget {
  std::string name;                   // for messages: "engine 1 (node3:50052)"
  engine::EngineClient* client = nullptr;
};

struct PushStats {
  uint64_t version = 0;
  int64_t buckets = 0;                // this rank's
  int64_t chunks = 0;                 // encoded (once each, for every engine)
  int64_t raw_bytes = 0;              // this rank's buckets, in the wire dtype
  int64_t sent_bytes = 0;             // payload bytes written, summed over the engines, resends included
  int64_t full_chunks = 0, xor_chunks = 0, sparse_chunks = 0;
  int64_t resent_chunks = 0;          // pushed again in full (summed over the engines)
  int64_t changed_elements = 0;       // elements that differ from the base (all of a full chunk's)
  double seconds = 0;                 // the whole push
  double pack_seconds = 0;            // packing the buckets and copying them to the host
  double encode_seconds = 0;          // encoding, summed over the threads
  std::vector<std::string> failed;    // per engine: why its push failed, "" when it succeeded
  bool all_succeeded() const;
};

// The standalone engines' shared secret: the first line of `token_file`, or $TILLER_ENGINE_TOKEN
// when it is empty ("" when neither). ConfigError naming the file when it has no first line.
std::string standalone_engine_token(const std::string& token_file);
// How a job's ranks dial a standalone engine at `address`: its secret (engines.token_file), TLS as
// engines.tls_* say, and timeouts.rpc_s.
engine::ClientOptions standalone_engine_client(const JobConfig& job, const std::string& address);

class WeightPusher {
 public:
  // Every actor rank (`actor.rank()` sends the plan's buckets whose sender it is). `plan` must be
  // make_bucket_plan's for this actor (checked, as the sync communicator's sender checks it).
  // ConfigError for options out of bounds.
  WeightPusher(zero::ShardedModel& actor, BucketPlan plan, PushOptions opts = {});
  ~WeightPusher();
  WeightPusher(const WeightPusher&) = delete;
  WeightPusher& operator=(const WeightPusher&) = delete;

  // Pushes the actor's current weights as `version` to every engine (each must have begun the
  // update with this plan). Returns when every engine answered, or failed (PushStats::failed names
  // it and why; the others are unaffected). The base advances to these weights whatever the
  // engines answered: an engine that missed them gets its next push's chunks in full.
  PushStats push(uint64_t version, const std::vector<PushTarget>& engines);
  const BucketPlan& plan() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct PushReceiveStats {
  uint64_t version = 0;
  int64_t chunks = 0;                 // applied
  int64_t refused_chunks = 0;         // not applicable (to be resent in full)
  int64_t payload_bytes = 0;          // of the applied chunks
  int64_t buckets_placed = 0;         // copied into the weights (an unchanged bucket already there is not)
  double seconds = 0;                 // receive() from its start to the last bucket in place
};

// The engine side: every TP rank of an engine that takes pushed syncs (a standalone `tiller
// engine`). The leader applies the chunks (take_chunk, on the service's handler threads, one per
// stream, in parallel) to its host copy of each bucket; its receive() places every finished bucket
// into the weights and, under tensor parallelism, broadcasts it to the followers over `tp`, where
// each rank copies its slices. Host memory: the wire bytes of the whole model on the leader, plus
// one staging buffer of the largest bucket on every rank's device.
class PushReceiver final : public engine::WeightSink {
 public:
  // `tp`: the engine's TP communicator (null without TP); `timeout_s` bounds one receive().
  PushReceiver(engine::Engine& engine, dist::Communicator* tp, double timeout_s);
  ~PushReceiver() override;

  uint64_t install_plan(const std::string& plan) override;
  uint64_t plan_id() const override;
  Result receive(uint64_t version) override;
  std::string take_chunk(const engine::WeightChunk& c, double wait_s) override;
  PushReceiveStats last() const;      // the last receive(), complete or not

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::sync
