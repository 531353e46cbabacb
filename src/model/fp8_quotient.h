// v / s as IEEE division rounds it, from s's reciprocal: for kernels that divide many values by
// one scale (FP8 quantization divides 128 or more values by each scale), a multiply and two or four
// FMAs in place of a division each. Host and device (the CPU test checks the claim below).
#pragma once

#include <math.h>

#ifdef __CUDACC__
#define TILLER_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TILLER_HOST_DEVICE inline
#endif

namespace tiller::model::fp8 {

// Scales at which the reciprocal form is used; outside them, divide (the callers do).
constexpr float kQuotientMinScale = 0x1p-100f, kQuotientMaxScale = 0x1p100f;

// With r = 1 / s rounded to nearest (one division per scale) and s in [kQuotientMinScale,
// kQuotientMaxScale]: the product v r, corrected kCorrections times by its exact residual v - s q
// (Markstein's iteration, as the hardware's own division sequence refines its quotient). Equal to
// v / s bit for bit wherever |v| >= 2^-100 and |v / s| >= 2^-100; elsewhere both are below 2^-12
// with v's sign, so that they quantize to the same e4m3 code (a signed zero).
// - One correction: checked over every pair of bf16 values and every pair of fp16 values |v| <=
//   amax, s = amax / 448 (the CPU, and the GPU for bf16: scripts/gpu/fp8_quantize_probe.cu), so
//   exact for two-byte inputs. Markstein's theorem needs a first quotient within an ulp, which
//   RN(v RN(1/s)) is not proven to be for every fp32 v;
// - two corrections: also 150M random fp32 pairs; what fp32 inputs take.
// A NaN v gives a NaN (the device's canonical one, as its division does); v = +-inf needs
// s = inf, which is outside the range.
template <int kCorrections = 2>
TILLER_HOST_DEVICE float quotient_by_reciprocal(float v, float s, float r) {
  static_assert(kCorrections == 1 || kCorrections == 2, "one or two corrections");
#ifdef __CUDA_ARCH__
  float q = __fmul_rn(v, r);  // rounded on its own, never fused
#else
  float q = v * r;
#endif
  float e = fmaf(-s, q, v);
  q = fmaf(e, r, q);
  if (kCorrections == 2) {
    e = fmaf(-s, q, v);
    q = fmaf(e, r, q);
  }
  return q != 0.f ? q : copysignf(0.f, v);  // the sign of a zero quotient is v's; a NaN stays canonical
}

}  // namespace tiller::model::fp8
