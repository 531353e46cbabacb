#include "tiller/algo/sft_loss.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "tiller/core/error.h"

namespace tiller::algo {

SftLoss sft_loss(const at::Tensor& logp, const at::Tensor& mask, const at::Tensor& cu, SftMean mean, double normalizer) {
  TILLER_CHECK(logp.dim() == 1 && mask.dim() == 1 && mask.numel() == logp.numel(), "sft_loss: {} log-probs, {} mask values",
               logp.numel(), mask.numel());
  TILLER_CHECK(normalizer > 0, "sft_loss: normalizer {} must be > 0", normalizer);
  const at::Tensor m = mask.to(logp.device(), logp.scalar_type());
  const at::Tensor nll = -(logp * m);
  SftLoss out;
  if (mean == SftMean::kToken) {
    out.loss = nll.sum() / normalizer;
  } else {
    const at::Tensor c = cu.to(at::kCPU, at::kLong).contiguous();
    const int64_t b = c.numel() - 1;
    TILLER_CHECK(b >= 0 && c.data_ptr<int64_t>()[b] == logp.numel(), "sft_loss: cu ends at {} for {} tokens",
                 b >= 0 ? c.data_ptr<int64_t>()[b] : -1, logp.numel());
    // Each sequence's mean over its trained tokens (a sequence with none adds nothing).
    const at::Tensor seg = at::repeat_interleave(at::arange(b, at::kLong), c.diff()).to(logp.device());
    const at::Tensor sums = at::zeros({b}, nll.options()).index_add(0, seg, nll);
    const at::Tensor counts = at::zeros({b}, m.options()).index_add(0, seg, m).clamp_min(1);
    out.loss = (sums / counts).sum() / normalizer;
  }
  at::NoGradGuard no_grad;
  out.nll = nll.detach().sum().item<double>();
  out.tokens = m.sum().item<int64_t>();
  return out;
}

}  // namespace tiller::algo
