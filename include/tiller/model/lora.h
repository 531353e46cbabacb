// LoRA adapters for the functional transformer, in PEFT's format and arithmetic.
//
// A targeted projection W [out, in] gets A [r, in] and B [out, r]; its output becomes
//   y = x W^T (+ bias) + scale * (dropout(x) A^T) B^T,   scale = alpha / r (alpha / sqrt(r) with rsLoRA)
// the adapter's path computed in the adapters' dtype and added to the base output in it, then
// rounded to the base's dtype (peft.tuners.lora.Linear.forward). The adapters live beside the base
// weights (LayerWeights::lora) and are never merged in the forward: the trainer and the engine run
// the same unmerged arithmetic, and the base stays the reference (BlockContext::lora_off).
//
// Names are PEFT's without its "base_model.model." prefix: "model.layers.3.self_attn.q_proj.lora_A.weight".
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/model_config.h"
#include "tiller/model/weights.h"

namespace tiller::model {

struct LoraSpec {
  int64_t rank = 0;  // 0: no adapters
  double alpha = 16;
  bool use_rslora = false;
  std::array<bool, kLoraModules> targets{};  // which projections of every layer carry adapters
  double scale() const;
  bool enabled() const { return rank > 0; }
  bool operator==(const LoraSpec& o) const {
    return rank == o.rank && alpha == o.alpha && use_rslora == o.use_rslora && targets == o.targets;
  }
};

// "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj".
const char* lora_module_name(LoraModule m);
// PEFT's target_modules: a comma-separated list of those names, or "all-linear" (every one of
// them; PEFT's all-linear skips the output head too). ConfigError naming `key` for another name,
// an empty list, or MLP targets on a mixture of experts (its experts take no adapters).
std::array<bool, kLoraModules> lora_targets(const std::string& list, const ModelConfig& cfg, const std::string& key);

// Every adapter tensor's name and shape, layer by layer (A before B, projections in LoraModule order).
std::vector<ParamSpec> lora_parameter_specs(const ModelConfig& cfg, const LoraSpec& spec);
// The adapters bound in `w` (LayerWeights::lora), under their PEFT names; none when unbound.
NamedTensors named_lora(const ModelWeights& w);
// PEFT's initialisation: A Kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B zero, so
// the adapted model starts as the base. fp32, on the CPU, drawn from `seed`.
NamedTensors init_lora(const ModelConfig& cfg, const LoraSpec& spec, uint64_t seed);
// Binds the adapters in `named` into `w` (views; every one the spec needs, with its shape; IoError
// naming `where` otherwise) and sets their scale.
void bind_lora(const ModelConfig& cfg, const LoraSpec& spec, const NamedTensors& named, ModelWeights& w,
               const std::string& where);

// A PEFT adapter directory: adapter_config.json (r, lora_alpha, target_modules, use_rslora,
// peft_type LORA) and adapter_model.safetensors, its tensors under our names.
struct PeftAdapter {
  LoraSpec spec;
  double dropout = 0;
  NamedTensors tensors;
};
// ConfigError / IoError naming the file and key: a missing file, another peft_type, a bias, DoRA or
// another variant tiller does not run, target modules it cannot map, a tensor missing or misshapen.
PeftAdapter read_peft_adapter(const std::string& dir, const ModelConfig& cfg);
// Writes `dir`/adapter_config.json and adapter_model.safetensors (each atomically) for PEFT to load
// onto `base_model` (the base's path, recorded as base_model_name_or_path).
void write_peft_adapter(const std::string& dir, const ModelConfig& cfg, const LoraSpec& spec, double dropout,
                        const NamedTensors& tensors, const std::string& base_model);

// W + scale * (B @ A), computed in fp32 and rounded to W's dtype (PEFT's merge on the CPU).
at::Tensor merge_lora(const at::Tensor& w, const at::Tensor& a, const at::Tensor& b, double scale);
// The base weights `base` (HF names) with every adapter of `adapters` merged in: a full checkpoint.
NamedTensors merge_lora(const ModelConfig& cfg, const LoraSpec& spec, const NamedTensors& base,
                        const NamedTensors& adapters);
// Writes `out_dir`: the HF checkpoint in `base_dir` with the adapters merged (in `dtype`, or each
// weight's own when undefined), and base_dir's other files (config, tokenizer, generation
// config). Returns the number of weights merged. ConfigError when out_dir is base_dir.
int64_t write_merged_model(const std::string& base_dir, const LoraSpec& spec, const NamedTensors& adapters,
                           const std::string& out_dir, std::optional<at::ScalarType> dtype = std::nullopt);

}  // namespace tiller::model
