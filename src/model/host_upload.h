// Host vectors to device tensors without stalling the host: on CUDA the data goes through pinned
// memory and a non-blocking copy (a copy from pageable memory synchronises the host with the
// stream first). Shared by the sampler and the engine's model runner; internal to tiller.
#pragma once

#include <algorithm>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

namespace tiller::model {

// A 1-D host tensor of `host`'s values (dtype from T: float -> fp32, int64_t -> int64), in pinned
// memory when `pinned`, ready for a non-blocking copy to the device.
template <typename T>
at::Tensor host_tensor(const std::vector<T>& host, bool pinned) {
  at::Tensor t = at::empty({static_cast<int64_t>(host.size())},
                           at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value).pinned_memory(pinned));
  std::copy(host.begin(), host.end(), t.data_ptr<T>());
  return t;
}

// A 1-D tensor of `host`'s values on `device`.
template <typename T>
at::Tensor upload(const std::vector<T>& host, at::Device device) {
  at::Tensor t = host_tensor(host, device.is_cuda());
  return device.is_cpu() ? t : t.to(device, /*non_blocking=*/true);
}

// `t` (any tensor) on `device` as `dtype` (its own when undefined); a host tensor travels through
// pinned memory with a non-blocking copy, so the host does not wait for the device's queue.
inline at::Tensor upload(const at::Tensor& t, at::Device device, std::optional<at::ScalarType> dtype = std::nullopt) {
  const at::ScalarType type = dtype.value_or(t.scalar_type());
  if (!t.device().is_cpu() || !device.is_cuda()) return t.to(device, type);
  at::Tensor pinned = at::empty(t.sizes(), at::TensorOptions().dtype(type).pinned_memory(true));
  pinned.copy_(t);
  return pinned.to(device, /*non_blocking=*/true);
}

}  // namespace tiller::model
