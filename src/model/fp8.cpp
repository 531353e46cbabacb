// FP8 (e4m3) block and group quantization (model/fp8.h).
#include "tiller/model/fp8.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::model::fp8 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_size(int64_t block, const char* what) {
  if (block < 1 || block > 4096) throw ConfigError(fmt::format("fp8: {} size {} is not in [1, 4096]", what, block));
}

// amax / 448, and 1 where amax is 0 (a block of zeros stays zeros whatever its scale).
at::Tensor scale_of(const at::Tensor& amax) {
  return at::where(amax > 0, amax / kE4m3Max, at::ones_like(amax));
}

// `scale` [nb, kb] expanded over the blocks and cut to [n, k].
at::Tensor expand_blocks(const at::Tensor& scale, int64_t block, int64_t n, int64_t k) {
  return scale.repeat_interleave(block, 0).repeat_interleave(block, 1).narrow(0, 0, n).narrow(1, 0, k);
}

// `scale` [..., groups] expanded along the last axis and cut to k.
at::Tensor expand_groups(const at::Tensor& scale, int64_t group, int64_t k) {
  return scale.repeat_interleave(group, -1).narrow(-1, 0, k);
}

}  // namespace

BlockQuantized quantize_blocks(const at::Tensor& w, int64_t block) {
  check_size(block, "block");
  if (w.dim() != 2) throw ConfigError(fmt::format("fp8: a block-quantized weight is 2-D, not {}-D", w.dim()));
  const int64_t n = w.size(0), k = w.size(1), nb = ceil_div(n, block), kb = ceil_div(k, block);
  const at::Tensor w32 = w.to(at::kFloat);
  // Zeros pad the edge blocks to whole ones; they change no block's largest magnitude.
  const at::Tensor padded = at::constant_pad_nd(w32, {0, kb * block - k, 0, nb * block - n}, 0);
  const at::Tensor amax = padded.abs().view({nb, block, kb, block}).amax({1, 3});
  const at::Tensor scale = scale_of(amax);
  const at::Tensor q = (w32 / expand_blocks(scale, block, n, k)).to(at::kFloat8_e4m3fn);
  return {q, scale};
}

at::Tensor dequantize_blocks(const BlockQuantized& b, c10::ScalarType dtype, int64_t block) {
  check_size(block, "block");
  const int64_t n = b.q.size(0), k = b.q.size(1);
  return (b.q.to(at::kFloat) * expand_blocks(b.scale, block, n, k)).to(dtype);
}

GroupQuantized quantize_groups(const at::Tensor& x, int64_t group) {
  check_size(group, "group");
  if (x.dim() < 1) throw ConfigError("fp8: activations need at least one axis");
  const int64_t k = x.size(-1), g = ceil_div(k, group);
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor padded = at::constant_pad_nd(x32, {0, g * group - k}, 0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(g);
  shape.push_back(group);
  const at::Tensor scale = scale_of(padded.abs().view(shape).amax(-1));
  const at::Tensor q = (x32 / expand_groups(scale, group, k)).to(at::kFloat8_e4m3fn);
  return {q, scale};
}

at::Tensor dequantize_groups(const GroupQuantized& g, c10::ScalarType dtype, int64_t group) {
  check_size(group, "group");
  return (g.q.to(at::kFloat) * expand_groups(g.scale, group, g.q.size(-1))).to(dtype);
}

at::Tensor linear_emulated(const at::Tensor& x, const BlockQuantized& w, int64_t block) {
  if (x.size(-1) != w.q.size(1))
    throw ConfigError(fmt::format("fp8: x has {} features and the weight {}", x.size(-1), w.q.size(1)));
  const at::Tensor xd = dequantize_groups(quantize_groups(x, block), at::kFloat, block);
  const at::Tensor wd = dequantize_blocks(w, at::kFloat, block);
  return at::matmul(xd, wd.t()).to(x.scalar_type());
}

}  // namespace tiller::model::fp8
