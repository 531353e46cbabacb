// Moving tensors' bytes off a device and back without changing the tensors.
//
// A StorageSwap holds the storages of a set of tensors (each storage once, however many tensors,
// views or aliases share it). offload() copies their bytes to host memory (pinned on CUDA, kept
// for the next offload) and frees the device allocations; reload() allocates them again and
// copies the bytes back. The StorageImpl objects stay, only their data pointers change, so every
// tensor, view and alias of them (an optimizer's lists of views, the fused projections' parts) is
// valid again after reload() and holds the same bytes. drop() frees without keeping the bytes
// (weights a sync refills); reload() after drop() allocates without copying (contents undefined).
//
// Streams: offload() waits for the device before it reads (every kernel that writes the storages
// is done) and after its copies (the host holds the bytes before the device memory is reused).
// reload() copies from pinned memory without waiting: the copies are ordered before whatever the
// current stream runs next; the next offload() waits for them before it overwrites the host copy.
// While offloaded, touching the tensors' data is an error (their storages have no bytes).
//
// Threading: one thread; the owner must not run kernels on the tensors from another thread meanwhile.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tiller::model {

class StorageSwap {
 public:
  // Every tensor must be defined and lie on one device. A storage that is a view of memory it does
  // not own (a memory-mapped checkpoint) is reloaded into memory of the device's allocator.
  explicit StorageSwap(const std::vector<at::Tensor>& tensors);
  ~StorageSwap();
  StorageSwap(const StorageSwap&) = delete;
  StorageSwap& operator=(const StorageSwap&) = delete;

  void offload();  // bytes to host, device memory freed; no-op when already off
  void drop();     // device memory freed, bytes not kept; no-op when already off
  void reload();   // device memory back (with the bytes unless drop()ped); no-op when resident
  bool resident() const;
  int64_t bytes() const;       // of the distinct storages
  int64_t host_bytes() const;  // host copies held

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The process's memory on a CUDA device as its caching allocator counts it (what the phases of the
// hybrid engine report): bytes in tensors, and bytes the allocator holds. Zeros on CPU.
struct DeviceMemory {
  int64_t allocated = 0, reserved = 0, peak_allocated = 0;
  int64_t total = 0;  // the device's memory (cudaMemGetInfo)
};
DeviceMemory device_memory(const at::Device& device);
// Starts a new peak for device_memory().peak_allocated (no-op on CPU).
void reset_peak_device_memory(const at::Device& device);
// Gives the caching allocator's unused blocks back to the driver (no-op on CPU). The hybrid
// process calls it at each phase change: blocks cut to one phase's sizes (the KV cache, the
// training activations) would otherwise fragment the next phase's memory, and NCCL's buffers and
// other allocations outside the allocator cannot use them at all.
void release_cached_device_memory(const at::Device& device);
// Caps what the process's caching allocator may hold on `device` at `bytes` (PyTorch's
// set_per_process_memory_fraction), when the device has more: a larger card then runs out of
// memory where a card of that size would (cluster.gpu_memory_gb, bench train --gpu-memory-gb).
// The CUDA context and NCCL's buffers come on top, as on the smaller card. Returns the device's
// memory when it capped, 0 when it did not (a CPU device, or a card no larger than `bytes`); 0
// bytes (or more than the card) lifts a cap.
int64_t cap_device_memory(const at::Device& device, int64_t bytes);
// Turns expandable segments of PyTorch's CUDA caching allocator on or off for the segments it maps
// from now on (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True at run time, as
// torch.cuda.memory._set_allocator_settings does). Unless PYTORCH_CUDA_ALLOC_CONF names
// expandable_segments: the user's setting wins (a warning says so). Returns the setting in force
// afterwards; false in a build without CUDA kernels.
bool set_expandable_segments(bool on);
// Bytes a new allocation on `device` can still take: the driver's free memory, and under a cap
// (cap_device_memory) no more than the cap leaves beside what the allocator holds. 0 on CPU. An
// engine sizes its KV cache from it (engines.gpu_memory_fraction).
int64_t device_free_bytes(const at::Device& device);

}  // namespace tiller::model
