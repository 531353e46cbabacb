#include "tiller/algo/sft_loss.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "tiller/algo/preference.h"
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
    // Each sequence's mean over its trained tokens (a sequence with none adds nothing).
    out.loss = -sequence_logps(logp, mask, cu, /*average=*/true).sum() / normalizer;
  }
  at::NoGradGuard no_grad;
  out.nll = nll.detach().sum().to(at::kDouble);
  out.tokens = m.sum().to(at::kDouble);
  return out;
}

SftLoss sft_loss_weighted(const at::Tensor& logp, const at::Tensor& mask, const at::Tensor& weight, double normalizer) {
  TILLER_CHECK(logp.dim() == 1 && mask.dim() == 1 && weight.dim() == 1 && mask.numel() == logp.numel() &&
                   weight.numel() == logp.numel(),
               "sft_loss_weighted: {} log-probs, {} mask values, {} weights", logp.numel(), mask.numel(), weight.numel());
  TILLER_CHECK(normalizer > 0, "sft_loss_weighted: normalizer {} must be > 0", normalizer);
  const at::Tensor m = mask.to(logp.device(), logp.scalar_type());
  const at::Tensor nll = -(logp * m);
  SftLoss out;
  out.loss = (nll * weight.to(logp.device(), logp.scalar_type())).sum() / normalizer;
  at::NoGradGuard no_grad;
  out.nll = nll.detach().sum().to(at::kDouble);
  out.tokens = m.sum().to(at::kDouble);
  return out;
}

}  // namespace tiller::algo
