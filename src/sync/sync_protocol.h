// What the sender and the receivers of a weight sync agree on: the header, the votes, where the
// small control tensors live, and the side stream each side issues its copies on.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "tiller/core/deadline.h"
#include "tiller/dist/communicator.h"

namespace tiller::sync::protocol {

constexpr int64_t kMagic = 0x54494c4c53594e43;  // "TILLSYNC"

// Header fields (int64), broadcast by sync rank 0.
enum Field { kMagicField = 0, kVersion = 1, kPlanId = 2, kBuckets = 3, kHeaderWords = 4 };

// A rank's vote on a header: 0 takes part; anything else refuses, and says why.
enum Vote : int64_t { kAccept = 0, kNotExpecting = 1, kOtherPlan = 2, kNoPlan = 3, kBadHeader = 4 };

inline const char* vote_reason(int64_t v) {
  switch (v) {
    case kNotExpecting: return "it was told to expect another version (BeginWeightUpdate names the version)";
    case kOtherPlan: return "it holds another bucket plan (install this plan first)";
    case kNoPlan: return "it has no bucket plan (install one first)";
    case kBadHeader: return "the header is malformed";
    default: return "unknown reason";
  }
}

// Small control tensors: on the device for NCCL, on the host for MPI.
inline at::TensorOptions control_options(const dist::Communicator& comm, at::Device device) {
  return at::TensorOptions().dtype(at::kLong).device(std::string(comm.backend()) == "nccl" ? device : at::kCPU);
}

// What every sender's send() starts with: its clock, the sync's deadline (the communicator's
// timeout set to it too), the control tensors' options and its rank.
struct SendStart {
  std::chrono::steady_clock::time_point t0;
  Deadline deadline;
  at::TensorOptions control;
  int me = 0;
};
inline SendStart begin_send(dist::Communicator& comm, double timeout_s, at::Device device) {
  SendStart s{std::chrono::steady_clock::now(), Deadline::after_seconds(timeout_s), {}, comm.rank()};
  comm.set_timeout(timeout_s);
  s.control = control_options(comm, device);
  return s;
}

inline int64_t to_word(uint64_t v) {
  int64_t w;
  static_assert(sizeof w == sizeof v);
  std::memcpy(&w, &v, sizeof w);
  return w;
}
inline uint64_t from_word(int64_t w) {
  uint64_t v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// While alive, work issued by this thread on `device` goes to one side stream of the pool (CUDA);
// a no-op on the CPU. synchronize() waits for what was issued on it.
class SideStream {
 public:
  explicit SideStream(at::Device device) {
#ifdef TILLER_HAVE_CUDA_KERNELS
    if (device.is_cuda()) guard_.emplace(c10::cuda::getStreamFromPool(false, device.index()));
#else
    (void)device;
#endif
  }
  void synchronize() {
#ifdef TILLER_HAVE_CUDA_KERNELS
    if (guard_) guard_->current_stream().synchronize();
#endif
  }

 private:
#ifdef TILLER_HAVE_CUDA_KERNELS
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
};

inline at::ScalarType wire_scalar_type(const std::string& dtype) {
  if (dtype == "bf16") return at::kBFloat16;
  if (dtype == "fp16") return at::kHalf;
  return at::kFloat;
}

inline std::string wire_dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32";
}

inline std::string refusals(const at::Tensor& votes, int senders) {
  std::string out;
  const at::Tensor v = votes.cpu();
  for (int64_t r = 0; r < v.numel(); ++r) {
    const int64_t code = v[r].item<int64_t>();
    if (code == kAccept) continue;
    if (!out.empty()) out += "; ";
    out += (r < senders ? "actor rank " : "engine sync rank ") + std::to_string(r) + ": " + vote_reason(code);
  }
  return out;
}

}  // namespace tiller::sync::protocol
