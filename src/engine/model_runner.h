// The engine's model runner: this rank's weights, the paged KV cache tensors, and one step's
// forward (packed prefill chunks and decodes in one batch) followed by sampling.
//
// KV cache layout: one tensor [layers, 2 (K, V), num_blocks * block_size, kv_heads, head_dim];
// token slot s of a sequence lives at row table[s / block_size] * block_size + s % block_size.
// Attention over the cache: new K/V are written into their slots, then each sequence attends
// over its slots (gathered into a packed K/V for varlen attention; decode steps on CUDA read the
// blocks in place with the paged decode kernel).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "engine/step_batch.h"
#include "tiller/model/model_config.h"
#include "tiller/model/weights.h"

namespace tiller::dist {
class Communicator;
}

namespace tiller::engine {

class ModelRunner {
 public:
  // `cfg` is the whole model's config; `weights` this rank's TP shard (see slice_for_tp).
  ModelRunner(const model::ModelConfig& cfg, model::ModelWeights weights, at::Device device, int64_t block_size,
              dist::Communicator* tp);
  ~ModelRunner();

  // Bytes one KV block takes on this rank (every layer, K and V).
  int64_t block_bytes() const;
  void allocate_cache(int64_t num_blocks);
  int64_t num_blocks() const { return num_blocks_; }
  at::Device device() const { return device_; }
  const model::ModelConfig& local_config() const { return local_; }

  struct Sampled {
    std::vector<int64_t> tokens;
    std::vector<float> logprobs;
  };
  // Runs the step. With `sample` (the leader) returns one token per sample row; followers pass
  // false and only take part in the forward's collectives.
  Sampled run(const StepBatch& batch, bool sample);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  model::ModelConfig local_;
  at::Device device_;
  int64_t num_blocks_ = 0;
};

}  // namespace tiller::engine
