// How one unit of a ZeRO-3 model (a transformer block; the embedding; the final norm and head)
// lies in one flat buffer, and which slice of it each rank of the group holds.
//
// Parameters sit in parameter_specs order, each starting on a multiple of kAlignElements (so a
// parameter view is 128-byte aligned for bf16 kernels); the total is padded to a multiple of
// world x kAlignElements and split evenly: rank r holds elements
// [r * shard_numel, (r + 1) * shard_numel). Padding is zero and never receives gradient.
// A pure value type: computed identically on every rank, no communication.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/weights.h"

namespace tiller::zero {

constexpr int64_t kAlignElements = 64;

struct FlatParam {
  model::ParamSpec spec;
  int64_t offset = 0;  // in the full flat buffer
  int64_t numel = 0;
};

// The part of one parameter that lies in one rank's shard.
struct ShardPiece {
  size_t param = 0;          // index into FlatLayout::params()
  int64_t param_begin = 0;   // first element, in the parameter's own (flattened) coordinates
  int64_t shard_begin = 0;   // where it lies in the shard
  int64_t numel = 0;
};

class FlatLayout {
 public:
  FlatLayout(std::string name, std::vector<model::ParamSpec> specs, int world);

  const std::string& name() const { return name_; }
  int world() const { return world_; }
  const std::vector<FlatParam>& params() const { return params_; }
  int64_t numel() const { return numel_; }                 // parameters only
  int64_t padded_numel() const { return shard_numel_ * world_; }
  int64_t shard_numel() const { return shard_numel_; }

  // Views of every parameter (in params() order, shaped) inside a full buffer of padded_numel().
  std::vector<at::Tensor> views(const at::Tensor& full) const;
  // Zeroes the alignment gaps and the tail padding of a full buffer (the parameters are left alone).
  void zero_padding(at::Tensor& full) const;
  // The pieces of parameters inside rank r's shard, in shard order.
  std::vector<ShardPiece> pieces(int rank) const;
  // 1 where weight decay applies in rank r's shard, 0 on no-decay parameters and padding.
  at::Tensor decay_mask(int rank, const at::TensorOptions& options) const;
  // Copies named full tensors (e.g. a checkpoint) into rank r's shard; every parameter must be there.
  void fill_shard(int rank, const model::NamedTensors& named, at::Tensor& shard, const std::string& where) const;

 private:
  std::string name_;
  int world_;
  std::vector<FlatParam> params_;
  int64_t numel_ = 0;
  int64_t shard_numel_ = 0;
};

// The units of a model in forward order: "embed" (the embedding), "layers.0" .. "layers.{L-1}",
// "head" (final norm, plus lm_head when untied or score for a value model).
std::vector<FlatLayout> model_layouts(const model::ModelConfig& cfg, model::Head head, int world);

}  // namespace tiller::zero
