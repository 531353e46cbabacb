#include "sync/bucket_packer.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "sync/protocol.h"
#include "tiller/core/error.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::sync {

BucketPacker::BucketPacker(const BucketPlan& plan, const zero::ShardedModel& actor, const std::string& what)
    : plan_(&plan) {
  const auto shards = actor.shards();
  if (shards.size() != plan.units.size())
    throw ConfigError(fmt::format("{}: the plan has {} units, the actor {}", what, plan.units.size(), shards.size()));
  const at::ScalarType wire = protocol::wire_scalar_type(plan.wire_dtype);
  for (size_t u = 0; u < shards.size(); ++u) {
    const auto& s = shards[u];
    if (s.name != plan.units[u].name || s.numel != plan.units[u].shard_numel)
      throw ConfigError(fmt::format("{}: plan unit {} is '{}' of {} elements per rank; the actor's is '{}' of {}", what,
                                    u, plan.units[u].name, plan.units[u].shard_numel, s.name, s.numel));
    // The compute shard when it has the wire's dtype (or is all there is); else the master, cast by
    // the copy into the bucket exactly as the compute shard was cast from it (an actor that casts
    // while gathering keeps no compute shard; a host optimizer's master is in host memory).
    const bool compute = s.compute.defined() && (s.compute.scalar_type() == wire || !s.master.defined());
    sources_.push_back(compute ? s.compute : s.master);
  }
  device_ = shards.front().compute.defined() ? shards.front().compute.device() : shards.front().master.device();
  const auto opts = at::TensorOptions().dtype(wire).device(device_);
  for (auto& b : buffers_) b = at::empty({plan.largest_bucket_numel()}, opts);
}

at::Tensor BucketPacker::buffer(size_t k) const { return buffers_[k % 2].narrow(0, 0, plan_->buckets.at(k).numel); }

void BucketPacker::pack(size_t k, int rank) const {
  const Bucket& b = plan_->buckets.at(k);
  if (b.sender != rank) return;
  at::Tensor buf = buffer(k);
  for (const auto& s : b.sources)
    buf.narrow(0, s.bucket_offset, s.numel).copy_(sources_[s.unit].narrow(0, s.shard_begin, s.numel));
}

}  // namespace tiller::sync
