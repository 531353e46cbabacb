// The parameters of the functional transformer, as structs of tensor views.
//
// The model code never owns parameters: the trainer binds views into its gathered ZeRO-3 block
// buffers, the engine binds its tensor-parallel shards, `tiller generate` binds a checkpoint's
// mapped tensors. `parameter_specs` is the one canonical list of names (Hugging Face names) and
// shapes that every owner of storage builds from.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/fp8.h"
#include "tiller/model/model_config.h"
#include "tiller/model/safetensors.h"

namespace tiller::model {

// Which output head the model carries: the LM head (tied to the embedding when the config says
// so) or the scalar value head of critic and reward models (HF's `score`, [1, hidden], no bias).
enum class Head { kLm, kValue };

// One routed expert of a mixture-of-experts layer: a SwiGLU MLP.
struct ExpertWeights {
  at::Tensor gate_proj, up_proj;  // [moe_intermediate, hidden]
  at::Tensor down_proj;           // [hidden, moe_intermediate]
};

// The projections LoRA adapters attach to (model/lora.h), in a fixed order.
enum class LoraModule { kQ, kK, kV, kO, kGate, kUp, kDown };
constexpr int kLoraModules = 7;
// A layer's LoRA adapters: a[m] [r, in] and b[m] [out, r] of each adapted projection m (undefined
// elsewhere), and their scale (alpha / r). block_forward adds them unmerged (lora.h).
struct LoraAdapters {
  std::array<at::Tensor, kLoraModules> a, b;
  double scale = 0;
};

struct LayerWeights {
  at::Tensor input_norm;                // [hidden]
  at::Tensor q_proj, k_proj, v_proj;    // [q_size|kv_size, hidden]
  at::Tensor q_bias, k_bias, v_bias;    // undefined unless attention_bias
  at::Tensor q_norm, k_norm;            // [head_dim]; undefined unless qk_norm
  at::Tensor o_proj;                    // [hidden, q_size]
  at::Tensor post_attn_norm;            // [hidden]
  at::Tensor gate_proj, up_proj;        // [intermediate, hidden]
  at::Tensor down_proj;                 // [hidden, intermediate]
  // A sparse layer (ModelConfig::sparse_layer): the router and the routed experts; gate/up/down_proj
  // above are then the shared expert ([shared_expert_intermediate, hidden] ...) behind the sigmoid
  // gate shared_expert_gate (qwen2_moe), or undefined.
  at::Tensor router;                    // [num_experts, hidden]
  std::vector<ExpertWeights> experts;
  at::Tensor shared_expert_gate;        // [1, hidden]
  // Optional fused projections (the engine's): when defined, block_forward runs one GEMM for
  // q/k/v ([q_size + 2 kv_size, hidden], bias likewise) and one for gate/up ([2 intermediate,
  // hidden]); the separate tensors above are then views into them.
  at::Tensor qkv_proj, qkv_bias, gate_up_proj;
  // Optional stacked experts (the engine's, for the grouped GEMMs of model::grouped_experts):
  // [experts, 2 moe_intermediate, hidden] (each expert's gate then up rows) and [experts, hidden,
  // moe_intermediate]; the experts' tensors are then views into them.
  at::Tensor experts_gate_up, experts_down;
  // The FP8 engine's (engines.quantization: fp8; model/fp8.h): the fused projections and o/down in
  // 128x128 blocks of e4m3. block_forward runs each defined one as an FP8 GEMM instead of its
  // tensor above, which stays as the weight sync's destination and the quantization's source.
  fp8::QuantizedWeight qkv_fp8, o_fp8, gate_up_fp8, down_fp8;
  LoraAdapters lora;  // none unless bound (model/lora.h: bind_lora)
};

struct ModelWeights {
  at::Tensor embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  at::Tensor final_norm;  // [hidden]
  at::Tensor lm_head;     // [vocab, hidden]; the embedding itself when tied; undefined for kValue
  at::Tensor score;       // [1, hidden]; kValue only
};

struct ParamSpec {
  std::string name;            // HF name, e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;
  int layer = -1;              // block index, or -1 for embedding / final norm / heads
  bool no_decay = false;       // norms and biases: no weight decay
  bool is_norm = false;        // initialised to ones
};

// Every parameter in a fixed order: embedding, the blocks in order, final norm, head.
// With a tied LM head there is no "lm_head.weight" entry.
std::vector<ParamSpec> parameter_specs(const ModelConfig& cfg, Head head = Head::kLm);

// How tensor parallelism splits the parameter named `hf_name` (the one rule of the engines'
// slicing, engine_weights.h, and the weight sync's plan, sync::tp_split_dim): 0 (its rows) for
// q/k/v and gate/up, weights and biases (Mixtral's experts' w1/w3 too), 1 (its columns) for
// o_proj and down_proj (w2), -1 (whole) for everything else; a LoRA adapter follows its
// projection on its own side: 0 for lora_B of q/k/v/gate/up, 1 for lora_A of o/down, else -1.
int tp_split_dim(const std::string& hf_name);

// Binds named tensors (HF names) into a ModelWeights, checking that every parameter is present
// with the right shape; `where` names the source in errors. Extra names are ignored (an actor
// checkpoint loaded as a critic has an lm_head that the critic does not use).
ModelWeights bind_weights(const ModelConfig& cfg, const NamedTensors& named, Head head, const std::string& where);

// Binds the parameters of block `layer` alone (the ZeRO-3 trainer binds one gathered block at a
// time); same checks as bind_weights.
LayerWeights bind_layer(const ModelConfig& cfg, int64_t layer, const NamedTensors& named, const std::string& where);

// The inverse of bind_weights: HF names -> the bound tensors (tied lm_head left out).
NamedTensors named_weights(const ModelConfig& cfg, const ModelWeights& w, Head head);

// Fresh parameters the way transformers initialises them: normal(0, initializer_range) for
// matrices and the embedding, ones for norms, zeros for biases; deterministic for a seed and
// device type. Generated on `device` (a 7B model is not drawn on the host first), one tensor at a
// time, and kept on `store` (default: `device`): drawn on a GPU and stored on the host, a large
// model is drawn in parallel (the host's generator is serial) and never fills the GPU.
NamedTensors init_weights(const ModelConfig& cfg, Head head, uint64_t seed, at::ScalarType dtype,
                          at::Device device = at::kCPU, std::optional<at::Device> store = std::nullopt);

// Loads a checkpoint directory (config.json + safetensors) as `dtype` on `device`.
// Returns owned tensors (copies, unless CPU and the dtype matches: then views of the mapping).
struct LoadedModel {
  ModelConfig config;
  NamedTensors tensors;
  ModelWeights weights;
};
LoadedModel load_model(const std::string& dir, Head head, at::ScalarType dtype, at::Device device);

// Writes config.json and the safetensors (sharded above max_shard_bytes) that transformers loads.
void save_model(const std::string& dir, const ModelConfig& cfg, const ModelWeights& w, Head head,
                uint64_t max_shard_bytes = 5ull << 30);

}  // namespace tiller::model
