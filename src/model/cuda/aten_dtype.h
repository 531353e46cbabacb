// The kernels' DType (kernels.h) of an ATen scalar type: bf16, fp16, and fp32 for anything else
// (callers check that the type is one of the three). C++ side of the GPU build only.
#pragma once

#include <c10/core/ScalarType.h>

#include "model/cuda/kernels.h"

namespace tiller::model::cuda {

inline DType kernel_dtype(c10::ScalarType t) {
  return t == c10::kBFloat16 ? DType::kBFloat16 : t == c10::kHalf ? DType::kHalf : DType::kFloat;
}

}  // namespace tiller::model::cuda
