// The shape of a decoder-only transformer of the Llama / Qwen2 / Qwen3 / Mistral families, read
// from (and written as) a Hugging Face `config.json`, or taken from a named preset.
//
// Both config dialects of transformers are read: `rope_theta` + `rope_scaling` (4.x, and every
// published Qwen/Llama checkpoint) and `rope_parameters` (5.x). Mixture-of-experts models
// (qwen2_moe, qwen3_moe, mixtral) carry their routing settings below. Anything the model code does
// not implement (another activation, partial rotary, ...) is rejected with the key named, never
// silently ignored.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tiller::model {

enum class Family { kLlama, kQwen2, kQwen3, kMistral, kQwen2Moe, kQwen3Moe, kMixtral };

const char* family_name(Family f);  // "llama", "qwen2", ... (HF model_type)

struct RopeScaling {
  std::string type = "default";  // default | linear | dynamic | llama3 | yarn
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;  // 0: max_position_embeddings
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  double beta_fast = 32.0;                       // yarn
  double beta_slow = 1.0;                        // yarn
  double attention_factor = 0.0;                 // yarn; 0: 0.1 ln(factor) + 1
  bool truncate = true;                          // yarn: integer correction range
};

struct ModelConfig {
  Family family = Family::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 4096;
  bool attention_bias = false;  // bias on q, k and v projections (Qwen2)
  bool qk_norm = false;         // RMSNorm over head_dim on q and k before RoPE (Qwen3)
  bool tie_word_embeddings = false;
  // Per layer: 0 = full causal attention, w > 0 = each token sees itself and the w-1 before it.
  std::vector<int64_t> layer_window;
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  int64_t pad_token_id = -1;
  double initializer_range = 0.02;
  std::string torch_dtype = "float32";  // what the checkpoint stores
  // Mixture of experts (num_experts 0: a dense model). A sparse layer's MLP is a router
  // ([num_experts, hidden]) choosing experts_per_token experts per token by softmax then top-k
  // (their weights renormalised to sum 1 with norm_topk_prob; mixtral always), each expert a SwiGLU
  // MLP of moe_intermediate_size; qwen2_moe adds a shared expert of shared_expert_intermediate_size
  // behind a sigmoid gate. Dense layers (qwen*_moe's mlp_only_layers and decoder_sparse_step) keep
  // the MLP of intermediate_size.
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t shared_expert_intermediate_size = 0;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;  // written back to config.json; tiller's own is algo.*

  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
  bool moe() const { return num_experts > 0; }
  // Whether layer i's MLP is the mixture of experts.
  bool sparse_layer(int64_t i) const;
};

// Reads DIR/config.json (or the file itself). Throws ConfigError naming the file and key.
ModelConfig load_model_config(const std::string& dir_or_file);
// Parses config.json text; `where` names the source in errors.
ModelConfig parse_model_config(const std::string& json_text, const std::string& where);
// The config.json that transformers loads as this model. With `value_head` the architecture is
// XForSequenceClassification with num_labels 1 (the `score` head), else XForCausalLM.
std::string to_hf_config_json(const ModelConfig& cfg, bool value_head = false);

// Consistency checks (divisibility, positivity); throws ConfigError prefixed with `where`.
void validate(const ModelConfig& cfg, const std::string& where);

// Architecture presets for tests and benchmarks: qwen2-0.5b, qwen2-1.5b, qwen2-7b, qwen3-30b-a3b
// (the published shapes) and qwen3-30b-a3b-8l (its first 8 layers), and tiny-llama, tiny-qwen2,
// tiny-qwen3, tiny-mistral, tiny-qwen3-moe, tiny-qwen2-moe, tiny-mixtral (a few hundred thousand
// parameters). Throws ConfigError listing the names for an unknown one.
ModelConfig preset(const std::string& name);
std::vector<std::string> preset_names();

// The longest sequence the model's positions are meant for: max_position_embeddings, or with RoPE
// scaling (linear, dynamic, yarn, llama3) the original length times the factor when that is more.
int64_t context_limit(const ModelConfig& cfg);
// The sequence length at which a causal sequence's attention (2 L heads head_dim FLOPs per token,
// each way) costs as much as the rest of a block (2 x its parameters per token): the packer's
// weight for long samples (controller/packer.h).
double attention_cost_tokens(const ModelConfig& cfg);

// Parameter count of the causal LM (lm_head counted once when tied; every expert).
int64_t num_parameters(const ModelConfig& cfg);
// Parameters one token runs through (the experts it is routed to, not all of them): the
// num_parameters of a dense model; what FLOPs per token follow.
int64_t active_parameters(const ModelConfig& cfg);

}  // namespace tiller::model
