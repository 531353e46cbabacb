// Where one engine rank's tensor-parallel slices of each bucket go (bucket_plan.h's copies),
// checked once per plan against the rank's weights. Shared by the two receiving sides: the
// disaggregated receiver (weight_receiver.cpp) and the hybrid handoff (hybrid_handoff.cpp), so
// both place the same bytes in the same places.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/sync/bucket_plan.h"

namespace tiller::engine {
class Engine;
}

namespace tiller::sync {

class SlicePlacer {
 public:
  SlicePlacer() = default;
  // Checks `plan` against the weights of `engine` (this rank's TP slices: names, shapes, dtype,
  // TP size): ConfigError naming the engine's TP rank and what does not fit. The destinations
  // are views of the engine's storage and stay valid across sleep and wake.
  // `lora_base`: the plan is a LoRA engine's base alone (the hybrid handoff refilling a base its
  // engine dropped), which must send every parameter but the adapters.
  SlicePlacer(const BucketPlan& plan, const engine::Engine& engine, bool lora_base = false);

  // Copies this rank's parts of bucket `k` (its first numel elements in `stage`) into place, on
  // the calling thread's current stream. Inside c10::InferenceMode (the weights are inference tensors).
  void place(size_t k, const at::Tensor& stage) const;

 private:
  std::vector<at::Tensor> dest_;                // per plan parameter: this rank's slice, flattened
  std::vector<std::vector<SliceCopy>> copies_;  // per bucket
};

}  // namespace tiller::sync
