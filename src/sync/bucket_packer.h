// The sending side of a weight sync (bucket_plan.h), shared by the disaggregated sender
// (weight_sender.cpp) and the hybrid handoff (hybrid_handoff.cpp), so both put the same bytes on
// the wire: the plan's units checked once against the actor's shards, the shard each unit's bytes
// are taken from, and the two staging buffers that buckets alternate between.
#pragma once

#include <array>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/sync/bucket_plan.h"

namespace tiller::zero {
class ShardedModel;
}

namespace tiller::sync {

class BucketPacker {
 public:
  // ConfigError, prefixed with `what` ("weight sync"), when the plan's units are not the actor's
  // (names, elements per rank). `plan` and `actor` must outlive the packer.
  // `lora_base`: `plan` is a full plan for the frozen base of a LoRA actor (its compute shards),
  // which the hybrid handoff sends to an engine that dropped its weights.
  BucketPacker(const BucketPlan& plan, const zero::ShardedModel& actor, const std::string& what,
               bool lora_base = false);

  // Bucket k's staging buffer (the first numel elements of buffer k % 2), in the wire dtype on the
  // actor's device. Its previous bucket (k - 2) must be off the wire before it is packed again.
  at::Tensor buffer(size_t k) const;
  // Copies this rank's parts of bucket k into buffer(k) when `rank` sends it (else nothing), on
  // the calling thread's current stream.
  void pack(size_t k, int rank) const;
  const at::Device& device() const { return device_; }

 private:
  const BucketPlan* plan_;
  at::Device device_ = at::kCPU;
  // Per unit: the wire dtype's values, from the compute shard when it is that dtype (what the
  // actor's own forward uses), else the fp32 master rounded once.
  std::vector<at::Tensor> sources_;
  std::array<at::Tensor, 2> buffers_;
};

}  // namespace tiller::sync
