// The engine's model runner: this rank's weights, the paged KV cache tensors, and one step's
// forward (packed prefill chunks and decodes in one batch) followed by sampling.
//
// KV cache layout: one tensor [layers, 2 (K, V), num_blocks * block_size, kv_heads, head_dim];
// token slot s of a sequence lives at row table[s / block_size] * block_size + s % block_size.
// Attention over the cache: new K/V are written into their slots, then each sequence attends
// over its slots. Prefill and mixed steps gather each sequence's slots into a packed K/V for
// varlen attention; decode steps on CUDA read the blocks in place with the paged decode kernel
// (src/model/cuda/), and, without tensor parallelism, replay a CUDA graph captured per batch
// size bucket (1, 2, 4, 8, then multiples of 8), padding the batch up to its bucket.
//
// The runner fuses q/k/v into one projection and gate/up into another (the separate weights stay
// as views into the fused ones, so writes through either reach the same storage).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
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
  // `cfg` is the whole model's config; `weights` this rank's TP shard (see slice_for_tp). With
  // `fp8` the fused projections and o/down are also held in e4m3 (`fp8_scaling`'s scales), which the
  // forward uses (LayerWeights::qkv_fp8 ...); the routed experts of a mixture, the embedding, the
  // norms, the router and the LM head stay in the weights' dtype. With `fp8_kv_cache` the KV cache
  // holds e4m3 codes with one fp32 scale per (token, KV head) row (model::fp8::quantize_rows), and
  // attention reads them dequantized to the weights' dtype, the step's own rows included.
  ModelRunner(const model::ModelConfig& cfg, model::ModelWeights weights, at::Device device, int64_t block_size,
              dist::Communicator* tp, bool fp8 = false,
              model::fp8::Scaling fp8_scaling = model::fp8::Scaling::kBlock, bool fp8_kv_cache = false);
  ~ModelRunner();

  // Bytes one KV block takes on this rank (every layer, K and V).
  int64_t block_bytes() const;
  // Bytes of one activation element (the compute dtype's, the embedding's).
  int64_t activation_bytes() const;
  struct CacheOptions {
    int64_t num_blocks = 0;
    int64_t max_model_len = 0;     // longest sequence (RoPE tables, graph block lists)
    bool cuda_graphs = true;       // decode steps on CUDA without TP; ignored elsewhere
    int64_t max_graph_batch = 256; // larger decode batches run eagerly
    bool rope_in_attention = true; // EngineOptions::rope_in_attention
    int64_t decode_pack_keys = 0;  // EngineOptions::decode_pack_keys
    bool fp8_fused = true;         // EngineOptions::fp8_fused (BlockContext::fp8_fused)
  };
  // Allocates the KV cache (again after release_cache(); its contents start at zero).
  void allocate_cache(const CacheOptions& opts);
  // Sleep (the hybrid engine): frees the KV cache and the captured decode graphs with their memory
  // pool; allocate_cache() wakes it. No step may be in flight.
  void release_cache();
  bool cache_allocated() const;
  // Frees the weights' device memory, contents lost (sleep level 2); restore_weights() allocates it
  // again, contents undefined until a weight sync writes them. Every parameter() view stays valid.
  void drop_weights();
  void restore_weights();
  bool weights_resident() const;
  uint64_t weight_drops() const;  // drop_weights() calls so far (their contents were lost each time)
  int64_t weight_bytes() const;  // of this rank's weights (FP8 copies included), resident or not
  // FP8: quantizes the weights again into the FP8 copies, in place (after a weight sync wrote the
  // weights). No step may be in flight. No-op without fp8.
  void requantize();
  bool fp8() const;
  int64_t cache_bytes() const;   // of the KV cache (and an FP8 cache's scales) while allocated, else 0
  bool fp8_kv_cache() const;
  // Whether decode steps use the paged kernel / CUDA graphs (for logs and benchmarks).
  bool paged_decode() const;
  bool cuda_graphs() const;
  int64_t num_blocks() const { return num_blocks_; }
  at::Device device() const { return device_; }
  const model::ModelConfig& local_config() const { return local_; }
  // This rank's weights by HF name: views of the runner's storage (see Engine::parameters).
  model::NamedTensors parameters() const;

  struct Sampled {
    std::vector<int64_t> tokens;
    std::vector<float> logprobs;
    // With record_routes and a mixture of experts: every row of the step's experts, [rows, width]
    // (width = sparse layers x experts per token; layer order, each layer's top-k in router order).
    std::vector<int16_t> routes;
    int64_t route_width = 0;
  };
  // Routing replay: whether steps that sample record each row's experts (Sampled::routes). A
  // captured MoE decode graph writes its routes in every replay (tensors of the graph), so turning
  // this on or off needs no recapture.
  void set_record_routes(bool on);
  // Enqueues the step on the device (the forward, and with `sample`, the sampler and the copy of
  // its ids and log-probs to pinned host memory) and returns without waiting for it. With
  // `sample`, collect() returns its draws, one per sample row, in launch order; followers pass
  // false and only take part in the forward's collectives. Rows listed in batch.prev_rows take
  // their token from the previous launch's draws, still on the device.
  void launch(const StepBatch& batch, bool sample);
  // Waits for the oldest launched step that was not collected yet and returns its draws.
  Sampled collect();
  // launch() then, with `sample`, collect().
  Sampled run(const StepBatch& batch, bool sample);

 private:
  at::Tensor run_packed(const StepBatch& batch, bool sample);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  model::ModelConfig local_;
  at::Device device_;
  int64_t num_blocks_ = 0;
};

}  // namespace tiller::engine
