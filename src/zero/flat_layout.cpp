#include "tiller/zero/flat_layout.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::zero {
namespace {
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

FlatLayout::FlatLayout(std::string name, std::vector<model::ParamSpec> specs, int world)
    : name_(std::move(name)), world_(world) {
  TILLER_CHECK(world > 0, "world must be > 0");
  int64_t offset = 0;
  for (auto& s : specs) {
    FlatParam p;
    p.numel = product(s.shape);
    p.offset = offset;
    p.spec = std::move(s);
    offset = round_up(offset + p.numel, kAlignElements);
    numel_ += p.numel;
    params_.push_back(std::move(p));
  }
  shard_numel_ = round_up(std::max<int64_t>(offset, 1), world_ * kAlignElements) / world_;
}

std::vector<at::Tensor> FlatLayout::views(const at::Tensor& full) const {
  TILLER_CHECK(full.dim() == 1 && full.numel() == padded_numel(), "unit {}: flat buffer of {} elements, expected {}",
               name_, full.numel(), padded_numel());
  std::vector<at::Tensor> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(full.narrow(0, p.offset, p.numel).view(p.spec.shape));
  return out;
}

void FlatLayout::zero_padding(at::Tensor& full) const {
  int64_t end = 0;
  for (const auto& p : params_) {
    if (p.offset > end) full.narrow(0, end, p.offset - end).zero_();
    end = p.offset + p.numel;
  }
  if (padded_numel() > end) full.narrow(0, end, padded_numel() - end).zero_();
}

std::vector<ShardPiece> FlatLayout::pieces(int rank) const {
  TILLER_CHECK(rank >= 0 && rank < world_, "rank {} outside [0, {})", rank, world_);
  const int64_t lo = rank * shard_numel_, hi = lo + shard_numel_;
  std::vector<ShardPiece> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t b = std::max(lo, params_[i].offset), e = std::min(hi, params_[i].offset + params_[i].numel);
    if (b < e) out.push_back({i, b - params_[i].offset, b - lo, e - b});
  }
  return out;
}

at::Tensor FlatLayout::decay_mask(int rank, const at::TensorOptions& options) const {
  at::Tensor m = at::zeros({shard_numel_}, options.device(at::kCPU));
  for (const auto& piece : pieces(rank))
    if (!params_[piece.param].spec.no_decay) m.narrow(0, piece.shard_begin, piece.numel).fill_(1);
  return m.to(options.device());
}

void FlatLayout::fill_shard(int rank, const model::NamedTensors& named, at::Tensor& shard, const std::string& where) const {
  TILLER_CHECK(shard.numel() == shard_numel_, "unit {}: shard of {} elements, expected {}", name_, shard.numel(), shard_numel_);
  shard.zero_();
  for (const auto& piece : pieces(rank)) {
    const auto& p = params_[piece.param];
    auto it = named.find(p.spec.name);
    if (it == named.end()) throw IoError(fmt::format("{}: missing tensor '{}'", where, p.spec.name));
    if (it->second.sizes().vec() != p.spec.shape)
      throw IoError(fmt::format("{}: tensor '{}' has the wrong shape", where, p.spec.name));
    at::Tensor src = it->second.reshape({-1}).narrow(0, piece.param_begin, piece.numel);
    shard.narrow(0, piece.shard_begin, piece.numel).copy_(src);
  }
}

std::vector<FlatLayout> model_layouts(const model::ModelConfig& cfg, model::Head head, int world) {
  std::vector<model::ParamSpec> embed, tail;
  std::vector<std::vector<model::ParamSpec>> layers(cfg.num_layers);
  for (auto& s : model::parameter_specs(cfg, head)) {
    if (s.layer >= 0) layers[s.layer].push_back(s);
    else if (s.name == "model.embed_tokens.weight") embed.push_back(s);
    else tail.push_back(s);
  }
  std::vector<FlatLayout> out;
  out.emplace_back("embed", std::move(embed), world);
  for (int64_t i = 0; i < cfg.num_layers; ++i) out.emplace_back(fmt::format("layers.{}", i), std::move(layers[i]), world);
  out.emplace_back("head", std::move(tail), world);
  return out;
}

}  // namespace tiller::zero
