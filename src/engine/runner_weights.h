// The forms a model runner gives its weights (model_runner.cpp): the rank's shape under tensor
// parallelism, the fused projections its GEMMs run on, and the FP8 engine's copies of them.
// Private to src/engine.
#pragma once

#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/fp8.h"
#include "tiller/model/model_config.h"
#include "tiller/model/weights.h"

namespace tiller::engine {

// The shape of one rank's slice of `cfg` at tensor parallelism `tp` (heads, KV heads and the
// MLPs' inner sizes divided; engine_weights.h slices the tensors so).
model::ModelConfig config_for_rank(const model::ModelConfig& cfg, int tp);

// The FP8 engine's copies of a layer's projections (LayerWeights::qkv_fp8 ...), each with the
// fused weight it is made from.
std::vector<std::pair<const at::Tensor*, model::fp8::QuantizedWeight*>> fp8_pairs(model::LayerWeights& w);
// Makes the layer's FP8 copies in `scaling`; requantize_layer writes them again in place (after
// a weight sync).
void quantize_layer(model::LayerWeights& w, model::fp8::Scaling scaling);
void requantize_layer(model::LayerWeights& w);

// q/k/v into one [q + 2 kv, hidden] projection and gate/up into one [2 I, hidden] (a sparse
// layer's experts stacked for the grouped GEMMs): two GEMMs per block instead of five. The
// separate tensors become views of the fused ones, so a weight sync writes through them.
void fuse_projections(model::LayerWeights& w);

}  // namespace tiller::engine
