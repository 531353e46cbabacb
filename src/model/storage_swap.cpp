#include "tiller/model/storage_swap.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

namespace tiller::model {
namespace {

// A byte tensor over the whole of `storage`.
at::Tensor byte_view(const c10::Storage& storage) {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(storage.device()));
  t.set_(storage, 0, {static_cast<int64_t>(storage.nbytes())}, {1});
  return t;
}

void synchronize(const at::Device& d) {
  if (d.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->synchronizeDevice(d.index());
}

}  // namespace

struct StorageSwap::Impl {
  struct Entry {
    c10::Storage storage;
    size_t nbytes = 0;
    c10::Allocator* allocator = nullptr;
    at::Tensor host;  // the bytes while offloaded (kept for reuse)
  };
  std::vector<Entry> entries;
  at::Device device = at::kCPU;
  bool resident = true;
  bool kept = false;  // the host copies hold the bytes (offload, not drop)
};

StorageSwap::StorageSwap(const std::vector<at::Tensor>& tensors) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  std::vector<const c10::StorageImpl*> seen;
  for (const auto& t : tensors) {
    TILLER_CHECK(t.defined() && t.has_storage(), "storage swap: an undefined tensor or one without storage");
    if (seen.empty()) m.device = t.device();
    TILLER_CHECK(t.device() == m.device, "storage swap: tensors on {} and {}", m.device.str(), t.device().str());
    const c10::Storage& s = t.storage();
    if (std::find(seen.begin(), seen.end(), s.unsafeGetStorageImpl()) != seen.end()) continue;
    seen.push_back(s.unsafeGetStorageImpl());
    // A storage without an allocator (a memory-mapped checkpoint's view) comes back in memory of
    // the device's default allocator.
    c10::Allocator* allocator = s.allocator() ? s.allocator() : c10::GetAllocator(s.device().type());
    TILLER_CHECK(allocator != nullptr, "storage swap: no allocator for {}", s.device().str());
    m.entries.push_back({s, s.nbytes(), allocator, {}});
  }
}

StorageSwap::~StorageSwap() = default;

bool StorageSwap::resident() const { return impl_->resident; }

int64_t StorageSwap::bytes() const {
  int64_t n = 0;
  for (const auto& e : impl_->entries) n += static_cast<int64_t>(e.nbytes);
  return n;
}

int64_t StorageSwap::host_bytes() const {
  int64_t n = 0;
  for (const auto& e : impl_->entries)
    if (e.host.defined()) n += e.host.numel();
  return n;
}

void StorageSwap::offload() {
  Impl& m = *impl_;
  if (!m.resident) return;
  synchronize(m.device);  // the writers, and the previous reload's copies from the host buffers
  for (auto& e : m.entries) {
    if (!e.host.defined() || e.host.numel() != static_cast<int64_t>(e.nbytes))
      e.host = at::empty({static_cast<int64_t>(e.nbytes)},
                         at::TensorOptions().dtype(at::kByte).pinned_memory(m.device.is_cuda()));
    e.host.copy_(byte_view(e.storage), /*non_blocking=*/m.device.is_cuda());
  }
  synchronize(m.device);
  for (auto& e : m.entries) {
    e.storage.set_data_ptr_noswap(at::DataPtr(nullptr, m.device));
    e.storage.set_nbytes(0);
  }
  m.resident = false;
  m.kept = true;
}

void StorageSwap::drop() {
  Impl& m = *impl_;
  if (!m.resident) return;
  synchronize(m.device);  // no kernel still reads them
  for (auto& e : m.entries) {
    e.storage.set_data_ptr_noswap(at::DataPtr(nullptr, m.device));
    e.storage.set_nbytes(0);
  }
  m.resident = false;
  m.kept = false;
}

void StorageSwap::reload() {
  Impl& m = *impl_;
  if (m.resident) return;
  // The allocator allocates on the current device: make it the tensors' (a caller's thread, an
  // engine's service thread among them, may stand on another GPU).
  c10::OptionalDeviceGuard on_device;
  if (!m.device.is_cpu()) on_device.reset_device(m.device);
  for (auto& e : m.entries) {
    e.storage.set_data_ptr_noswap(e.allocator->allocate(e.nbytes));
    e.storage.set_nbytes(e.nbytes);
    if (m.kept) byte_view(e.storage).copy_(e.host, /*non_blocking=*/m.device.is_cuda());
  }
  m.resident = true;
}

DeviceMemory device_memory(const at::Device& device) {
  DeviceMemory out;
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (device.is_cuda()) {
    // The allocator sets itself up at the first allocation; before that it holds nothing.
    if (c10::cuda::CUDACachingAllocator::get()->initialized()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
      const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      out.allocated = stats.allocated_bytes[all].current;
      out.reserved = stats.reserved_bytes[all].current;
      out.peak_allocated = stats.allocated_bytes[all].peak;
    }
    c10::cuda::CUDAGuard guard(device.index());
    size_t free = 0, total = 0;
    TILLER_CHECK(cudaMemGetInfo(&free, &total) == cudaSuccess, "cudaMemGetInfo failed on {}", device.str());
    out.total = static_cast<int64_t>(total);
  }
#else
  (void)device;
#endif
  return out;
}

void release_cached_device_memory(const at::Device& device) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (device.is_cuda() && c10::cuda::CUDACachingAllocator::get()->initialized()) {
    c10::cuda::CUDAGuard guard(device.index());
    c10::cuda::CUDACachingAllocator::emptyCache();
  }
#else
  (void)device;
#endif
}

namespace {
// cap_device_memory's caps by device index (0: none).
std::mutex g_caps_mu;
std::map<int, int64_t> g_caps;
}  // namespace

int64_t cap_device_memory(const at::Device& device, int64_t bytes) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (!device.is_cuda()) return 0;
  c10::cuda::CUDAGuard guard(device.index());
  size_t free = 0, total = 0;
  TILLER_CHECK(cudaMemGetInfo(&free, &total) == cudaSuccess, "cudaMemGetInfo failed on {}", device.str());
  // The allocator of a device is set up by its first allocation; the fraction needs it.
  (void)at::empty({1}, at::TensorOptions().device(device));
  const bool cap = bytes > 0 && static_cast<size_t>(bytes) < total;
  c10::cuda::CUDACachingAllocator::setMemoryFraction(
      cap ? static_cast<double>(bytes) / static_cast<double>(total) : 1.0, device.index());
  {
    std::lock_guard<std::mutex> lock(g_caps_mu);
    g_caps[device.index()] = cap ? bytes : 0;
  }
  return cap ? static_cast<int64_t>(total) : 0;
#else
  (void)device;
  (void)bytes;
  return 0;
#endif
}

bool set_expandable_segments(bool on) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  const char* env = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  if (env == nullptr || std::string(env).find("expandable_segments") == std::string::npos)
    c10::CachingAllocator::setAllocatorSettings(on ? "expandable_segments:True" : "expandable_segments:False");
  // The setting as parsed. Not CUDAAllocatorConfig::expandable_segments(): that inline accessor
  // answers false (with a warning, "not supported on this platform") in any translation unit
  // built without PyTorch's own PYTORCH_C10_DRIVER_API_SUPPORTED, although c10_cuda, built with
  // it, honours the setting (ModelGpu.ExpandableSegmentsTurnedOnAtRunTimeLeaveNoHoles).
  const bool in_force = c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
  if (in_force != on)
    log::warn("cluster.expandable_segments: the memory plan asks {}, but {} expandable segments {}",
              on ? "on" : "off",
              env ? fmt::format("PYTORCH_CUDA_ALLOC_CONF={} turns", env) : std::string("PyTorch's allocator keeps"),
              in_force ? "on" : "off");
  return in_force;
#else
  (void)on;
  return false;
#endif
}

int64_t device_free_bytes(const at::Device& device) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (!device.is_cuda()) return 0;
  c10::cuda::CUDAGuard guard(device.index());
  size_t free = 0, total = 0;
  TILLER_CHECK(cudaMemGetInfo(&free, &total) == cudaSuccess, "cudaMemGetInfo failed on {}", device.str());
  int64_t cap = 0;
  {
    std::lock_guard<std::mutex> lock(g_caps_mu);
    auto it = g_caps.find(device.index());
    if (it != g_caps.end()) cap = it->second;
  }
  if (cap <= 0) return static_cast<int64_t>(free);
  return std::min(static_cast<int64_t>(free), std::max<int64_t>(0, cap - device_memory(device).reserved));
#else
  (void)device;
  return 0;
#endif
}

void reset_peak_device_memory(const at::Device& device) {
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (device.is_cuda() && c10::cuda::CUDACachingAllocator::get()->initialized())
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#else
  (void)device;
#endif
}

}  // namespace tiller::model
