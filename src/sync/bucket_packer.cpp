#include "sync/bucket_packer.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "sync/sync_protocol.h"
#include "tiller/core/error.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::sync {

BucketPacker::BucketPacker(const BucketPlan& plan, const zero::ShardedModel& actor, const std::string& what,
                           bool lora_base)
    : plan_(&plan) {
  const at::ScalarType wire = protocol::wire_scalar_type(plan.wire_dtype);
  if (lora_base && (!actor.lora() || plan.adapters_only()))
    throw ConfigError(fmt::format("{}: a LoRA base's plan needs a LoRA actor and a full plan", what));
  if (!lora_base && (plan.adapters_only() || actor.lora())) {  // a LoRA actor sends its fp32 adapters alone
    if (!plan.adapters_only() || !actor.lora())
      throw ConfigError(fmt::format("{}: {}", what,
                                    actor.lora() ? "a LoRA actor syncs its adapters only: its plan must be "
                                                   "make_lora_bucket_plan's (the engines keep the base they loaded)"
                                                 : "an adapter-only plan, but the actor has no LoRA adapters"));
    const at::Tensor flat = actor.lora_flat();
    if (flat.numel() != plan.units[0].shard_numel || wire != at::kFloat)
      throw ConfigError(fmt::format("{}: the plan's adapters are {} {} elements, the actor's {} fp32", what,
                                    plan.units[0].shard_numel, plan.wire_dtype, flat.numel()));
    sources_.push_back(flat);
    device_ = flat.device();
    for (auto& b : buffers_) b = at::empty({plan.largest_bucket_numel()}, flat.options());
    return;
  }
  const auto shards = actor.shards();
  if (shards.size() != plan.units.size())
    throw ConfigError(fmt::format("{}: the plan has {} units, the actor {}", what, plan.units.size(), shards.size()));
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
