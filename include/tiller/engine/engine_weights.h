// An engine's weights: this rank's tensor-parallel slice of each parameter.
#pragma once

#include <string>

#include "tiller/model/lora.h"
#include "tiller/model/model_config.h"
#include "tiller/model/weights.h"

namespace tiller::engine {

// Loads an HF checkpoint directory for an engine: this rank's tensor-parallel slice of every
// parameter (q/k/v, gate/up and their biases by output rows; o_proj and down_proj by input
// columns; norms, embedding and LM head whole), in `dtype` (auto: bf16 on CUDA, fp32 on CPU;
// bf16, fp16, fp32) on `device`.
// Throws ConfigError when the heads or the MLP width do not divide by tp_size.
struct EngineWeights {
  model::ModelConfig config;       // the checkpoint's (global) config
  model::ModelWeights weights;     // this rank's slices
};
EngineWeights load_engine_weights(const std::string& dir, int tp_rank, int tp_size, const std::string& dtype,
                                  const std::string& device);
// The same slicing applied to weights already in memory (tests, and the weight sync's layout).
model::ModelWeights slice_for_tp(const model::ModelConfig& cfg, const model::ModelWeights& full, int tp_rank,
                                 int tp_size);

// LoRA adapters (PEFT names, model/lora.h; `adapters` whole, on any device) bound unmerged into an
// engine rank's `weights` (slice_for_tp's), as the trainer runs them: this TP rank's slice of each,
// in fp32 on `device`. B by rows for q/k/v/gate/up (their outputs are split over the ranks), A by
// columns for o/down (their inputs are), the others whole; so each rank's adapter path adds its
// slice of the output, or its partial sum before the all-reduce, like the base projection beside
// it. IoError naming `where` for a missing or misshapen adapter.
void bind_lora_for_tp(const model::ModelConfig& cfg, const model::LoraSpec& spec, const model::NamedTensors& adapters,
                      model::ModelWeights& weights, int tp_rank, int tp_size, const std::string& device,
                      const std::string& where);

}  // namespace tiller::engine
