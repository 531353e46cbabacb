// The weight sync: the actor's weights, from its ZeRO-3 shards to every engine rank, in buckets
// over one communicator (bucket_plan.h says which bytes go where).
//
// The sync communicator spans the actor group and every engine rank: sync rank i < A is actor
// group rank i, the engine ranks follow (dist/groups.h makes it from the rank plan once at start-up;
// NCCL on GPUs, MPI on CPUs). One sync is:
//   header   actor rank 0 broadcasts {version, plan id, buckets};
//   votes    every rank says whether it takes part (an engine refuses a version it was not told to
//            expect by Begin, or another plan); one all-reduce; a refusal ends the sync on every
//            rank before any weight changes, and names who refused and why;
//   buckets  bucket k is broadcast by its sender; a sender packs (and converts to the wire dtype)
//            its next bucket on a side stream while the previous bucket is on the wire (two
//            buffers); engines receive into two staging buffers and copy their TP slices into the
//            weights on a side stream while the next bucket arrives;
//   done     one all-reduce once every engine's copies are finished: send() returns then.
// Every operation has the sync's deadline. A failure before the buckets leaves the engine's
// weights as they were; a failure during them leaves them partly written, which the engine
// reports (weights_changed) and then refuses to serve until a sync completes.
//
// Threading: one thread drives a sender or a receiver (the receiver runs on the engine's thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tiller/core/error.h"
#include "tiller/engine/weight_sink.h"
#include "tiller/sync/bucket_plan.h"

namespace tiller::dist {
class Communicator;
}
namespace tiller::zero {
class ShardedModel;
}
namespace tiller::engine {
class Engine;
}

namespace tiller::sync {

// The engines said no (wrong version or plan): nothing was sent, no weight changed.
class SyncRefused : public Error {
 public:
  using Error::Error;
};

struct SyncStats {
  uint64_t version = 0;
  int64_t buckets = 0;
  int64_t wire_bytes = 0;    // on the wire, per receiving rank
  double seconds = 0;        // header to done, on this rank
};

class WeightSender {
 public:
  // Every actor rank. `plan` must be make_bucket_plan's for this model and group (checked);
  // `comm` is the sync communicator, `actor` and `comm` must outlive the sender.
  WeightSender(zero::ShardedModel& actor, dist::Communicator& comm, BucketPlan plan, double timeout_s);
  ~WeightSender();
  WeightSender(const WeightSender&) = delete;
  WeightSender& operator=(const WeightSender&) = delete;

  // Collective over the sync communicator (every engine rank in WeightReceiver::receive): sends
  // the actor's current weights (the compute shards, or the fp32 masters when the wire dtype is
  // another) as `version`. Throws SyncRefused when an engine refuses, TimeoutError / CommError
  // when the communicator fails (it is then aborted).
  SyncStats send(uint64_t version);
  const BucketPlan& plan() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class WeightReceiver final : public engine::WeightSink {
 public:
  // Every engine rank, for its engine (TP rank `engine.tp_rank()`); `comm` is the sync
  // communicator, whose ranks below `senders` are the actor's. Both must outlive the receiver.
  WeightReceiver(engine::Engine& engine, dist::Communicator& comm, double timeout_s);
  ~WeightReceiver() override;

  uint64_t install_plan(const std::string& plan) override;
  uint64_t plan_id() const override;
  Result receive(uint64_t version) override;
  const SyncStats& last() const;  // the last completed sync

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::sync
