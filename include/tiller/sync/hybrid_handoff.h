// The weight sync of the hybrid engine (cluster.hybrid): the actor's weights to the engine that
// runs in the same process, on the same GPU, without the host.
//
// Why in-process and not CUDA IPC between two processes (docs/sync.md): the engine's memory comes
// and goes (sleep and wake), which an IPC handle of a fixed buffer cannot follow without a second
// handshake per phase; in one process the trainer and the engine share one caching allocator, so
// what the sleeping engine frees is what the trainer allocates next, and the copy's completion is
// an ordinary stream synchronisation. The engine keeps its gRPC service for the controller.
//
// Actor group rank r hosts TP rank r % tp of engine r / tp. One handoff to `version`:
//   park     the engine's thread enters LocalWeightSink::receive() (the controller's
//            BeginWeightUpdate) and waits there; the actor thread's send() waits for it (deadline);
//   votes    one all-reduce over the actor group: every rank says whether its engine is parked on
//            this version, holds this plan and has its weights' memory (awake at least to level 1);
//            a refusal ends the handoff on every rank before any weight changes, naming who and why;
//   buckets  bucket k is broadcast over the actor group by the rank whose shard holds its bytes,
//            so every rank sees every bucket (the weights gathered one bucket at a time, over NCCL
//            between GPUs), and each rank copies its engine's TP slices of it into the engine's
//            weights on the same device (two buffers: bucket k + 1 travels while k is placed);
//   done     the device is synchronised (the copies are complete), one all-reduce of success, and
//            the engine's receive() returns the outcome.
// The bytes and the slices are the disaggregated sync's (bucket_plan.h, the same plan): the two
// give bit-identical engine weights.
//
// Threading: send() runs on the actor's thread (RoleWorker), receive() on the engine's (its
// server loop, or a TP follower's follow()), in the same process.
#pragma once

#include "tiller/sync/weight_sync.h"  // SyncStats, SyncRefused, and the declarations both use

namespace tiller::sync {

// The engine side: set as the engine's weight sink; receive() parks the engine's thread until the
// handoff on the actor's thread has written the weights (or until timeout_s).
class LocalWeightSink final : public engine::WeightSink {
 public:
  // `engine` must outlive the sink.
  LocalWeightSink(engine::Engine& engine, double timeout_s);
  ~LocalWeightSink() override;

  uint64_t install_plan(const std::string& plan) override;
  uint64_t plan_id() const override;
  Result receive(uint64_t version) override;

 private:
  friend class HybridHandoff;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class HybridHandoff {
 public:
  // Every actor rank. `comm` is the actor group's weight-sync communicator (dist/groups.h: the
  // actor's ranks, in order), `plan` the job's (job_bucket_plan), `sink` this rank's engine's.
  // All must outlive the handoff. ConfigError when the plan does not fit the actor or the engine.
  HybridHandoff(zero::ShardedModel& actor, dist::Communicator& comm, BucketPlan plan, LocalWeightSink& sink,
                double timeout_s);
  ~HybridHandoff();
  HybridHandoff(const HybridHandoff&) = delete;
  HybridHandoff& operator=(const HybridHandoff&) = delete;

  // Collective over `comm`: the weights to this rank's engine as `version` (see above). Throws
  // SyncRefused (no weight changed) or CommError / TimeoutError; the engine's receive() returns
  // the same outcome.
  SyncStats send(uint64_t version);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::sync
