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

// `x` [n, k] zero-padded to whole blocks and seen as [nb, block, kb, block] (zeros change no
// block's largest magnitude); the scales then apply by broadcasting, without an expanded copy.
at::Tensor as_blocks(const at::Tensor& x, int64_t block) {
  const int64_t n = x.size(0), k = x.size(1), nb = ceil_div(n, block), kb = ceil_div(k, block);
  return at::constant_pad_nd(x, {0, kb * block - k, 0, nb * block - n}, 0).view({nb, block, kb, block});
}
// The inverse: [nb, block, kb, block] back to [n, k].
at::Tensor from_blocks(const at::Tensor& b, int64_t n, int64_t k) {
  return b.view({b.size(0) * b.size(1), b.size(2) * b.size(3)}).narrow(0, 0, n).narrow(1, 0, k);
}

// `x` [..., k] zero-padded to whole groups and seen as [..., g, group].
at::Tensor as_groups(const at::Tensor& x, int64_t group) {
  const int64_t k = x.size(-1), g = ceil_div(k, group);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(g);
  shape.push_back(group);
  return at::constant_pad_nd(x, {0, g * group - k}, 0).view(shape);
}
at::Tensor from_groups(const at::Tensor& g, int64_t k) {
  std::vector<int64_t> shape(g.sizes().begin(), g.sizes().end() - 2);
  shape.push_back(g.size(-2) * g.size(-1));
  return g.reshape(shape).narrow(-1, 0, k);
}

}  // namespace

BlockQuantized quantize_blocks(const at::Tensor& w, int64_t block) {
  check_size(block, "block");
  if (w.dim() != 2) throw ConfigError(fmt::format("fp8: a block-quantized weight is 2-D, not {}-D", w.dim()));
  const at::Tensor blocks = as_blocks(w.to(at::kFloat), block);
  const at::Tensor scale = scale_of(blocks.abs().amax({1, 3}));
  const at::Tensor q = (blocks / scale.unsqueeze(1).unsqueeze(3)).to(at::kFloat8_e4m3fn);
  return {from_blocks(q, w.size(0), w.size(1)).contiguous(), scale};
}

at::Tensor dequantize_blocks(const BlockQuantized& b, c10::ScalarType dtype, int64_t block) {
  check_size(block, "block");
  const at::Tensor blocks = as_blocks(b.q.to(at::kFloat), block);
  return from_blocks(blocks * b.scale.unsqueeze(1).unsqueeze(3), b.q.size(0), b.q.size(1)).to(dtype);
}

GroupQuantized quantize_groups(const at::Tensor& x, int64_t group) {
  check_size(group, "group");
  if (x.dim() < 1) throw ConfigError("fp8: activations need at least one axis");
  const at::Tensor groups = as_groups(x.to(at::kFloat), group);
  const at::Tensor scale = scale_of(groups.abs().amax(-1));
  const at::Tensor q = (groups / scale.unsqueeze(-1)).to(at::kFloat8_e4m3fn);
  return {from_groups(q, x.size(-1)).contiguous(), scale};
}

at::Tensor dequantize_groups(const GroupQuantized& g, c10::ScalarType dtype, int64_t group) {
  check_size(group, "group");
  return from_groups(as_groups(g.q.to(at::kFloat), group) * g.scale.unsqueeze(-1), g.q.size(-1)).to(dtype);
}

at::Tensor linear_emulated(const at::Tensor& x, const BlockQuantized& w, int64_t block) {
  if (x.size(-1) != w.q.size(1))
    throw ConfigError(fmt::format("fp8: x has {} features and the weight {}", x.size(-1), w.q.size(1)));
  const at::Tensor xd = dequantize_groups(quantize_groups(x, block), at::kFloat, block);
  const at::Tensor wd = dequantize_blocks(w, at::kFloat, block);
  return at::matmul(xd, wd.t()).to(x.scalar_type());
}

}  // namespace tiller::model::fp8
