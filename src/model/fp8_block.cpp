// A transformer block with tensor-scaled FP8 projections, its quantization fused into the norms
// and SwiGLU (model/block_parts.h).
#include <c10/core/GradMode.h>

#include "model/block_parts.h"
#include "model/fp8_rows.h"
#include "tiller/core/error.h"

namespace tiller::model {

bool fp8_fused_block(const LayerWeights& w, const BlockContext& ctx) {
  if (!ctx.fuse_residual || !ctx.fp8_fused || ctx.reduce_partial_sums || ctx.fp8_training || w.router.defined() ||
      !w.qkv_proj.defined() || !w.gate_up_proj.defined())
    return false;
  for (const fp8::QuantizedWeight* q : {&w.qkv_fp8, &w.o_fp8, &w.gate_up_fp8, &w.down_fp8})
    if (!q->defined() || q->scaling != fp8::Scaling::kTensor) return false;
  if (!ctx.lora_off)
    for (const at::Tensor& a : w.lora.a)
      if (a.defined()) return false;
  return true;
}

at::Tensor fp8_block_forward(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& x,
                             BlockContext& ctx) {
  TILLER_CHECK(!(at::GradMode::is_enabled() && x.requires_grad()), "the fused FP8 block is inference only");
  const double eps = cfg.rms_norm_eps;
  const at::ScalarType dtype = x.scalar_type();
  at::Tensor stream = x;  // the residual stream, updated in place
  fp8::RowCodes h;
  if (ctx.deferred.defined()) {
    h = fp8::add_rms_norm_codes(stream, ctx.deferred, ctx.deferred_scale, w.input_norm, eps);
    ctx.deferred = at::Tensor();
    ctx.deferred_scale = at::Tensor();
  } else {
    h = fp8::quantize_row_codes(rms_norm(x, w.input_norm, eps).contiguous());
  }
  const at::Tensor qkv = fp8::unscaled_product(h, w.qkv_fp8, dtype);
  fp8::scale_rows_(qkv, h.scale, w.qkv_bias);
  const fp8::RowCodes attn = fp8::quantize_row_codes(attend_qkv(cfg, layer, w, qkv, ctx).contiguous());
  const at::Tensor o = fp8::unscaled_product(attn, w.o_fp8, dtype);
  const fp8::RowCodes h2 = fp8::add_rms_norm_codes(stream, o, attn.scale, w.post_attn_norm, eps);
  const fp8::RowCodes act = fp8::swiglu_codes(fp8::unscaled_product(h2, w.gate_up_fp8, dtype), h2.scale);
  ctx.deferred = fp8::unscaled_product(act, w.down_fp8, dtype);
  ctx.deferred_scale = act.scale;
  return stream;
}

}  // namespace tiller::model
