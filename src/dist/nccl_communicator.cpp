#include "nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::dist {
namespace {

#define TILLER_CUDA_OK(expr)                                                                      \
  do {                                                                                            \
    cudaError_t err_ = (expr);                                                                    \
    if (err_ != cudaSuccess) throw CommError(fmt::format("{}: {}", #expr, cudaGetErrorString(err_))); \
  } while (0)

ncclDataType_t nccl_type(at::ScalarType t, bool reducing) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kDouble: return ncclFloat64;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    case at::kBool:
      if (!reducing) return ncclUint8;
      break;
    default: break;
  }
  throw CommError(fmt::format("dtype {} is not supported by the NCCL backend{}", c10::toString(t),
                              reducing ? " for reductions" : ""));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

const char* op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : op == ReduceOp::kMax ? "max" : "min"; }

// Shared by the communicator, its Works and the watchdog.
struct NcclGroup {
  ncclComm_t comm = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  std::string name;
  std::mutex mu;  // guards aborted/abort_reason and the pending list
  bool aborted = false;
  std::string abort_reason;

  // Aborts once; the first reason wins. ncclCommAbort may be called from any thread.
  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted) return;
    aborted = true;
    abort_reason = reason;
    log::error("{}", reason);
    if (comm != nullptr) ncclCommAbort(comm);
  }
  std::string describe(const std::string& op, std::uint64_t seq) const {
    return fmt::format("{} #{} on group '{}' (nccl, rank {} of {}, cuda:{})", op, seq, name, rank, size, device);
  }
};

struct OpState {
  std::string op;
  std::uint64_t seq = 0;
  Deadline deadline = Deadline::never();
  cudaEvent_t done = nullptr;
  std::vector<at::Tensor> keep;  // alive until the op is complete
  std::atomic<bool> complete{false};
  ~OpState() {
    if (done != nullptr) cudaEventDestroy(done);
  }
};

// Polls `group`'s async state until it is not ncclInProgress; aborts at the deadline.
void wait_ready(NcclGroup& g, const std::string& what, Deadline deadline) {
  ncclResult_t state = ncclInProgress;
  while (true) {
    ncclResult_t rc = ncclCommGetAsyncError(g.comm, &state);
    if (rc != ncclSuccess) state = rc;
    if (state != ncclInProgress) break;
    if (deadline.expired()) {
      std::string reason = fmt::format("{} missed its deadline; the communicator is aborted", what);
      g.abort(reason);
      throw TimeoutError(reason);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  if (state != ncclSuccess) {
    std::string reason = fmt::format("{} failed: {} ({})", what, ncclGetErrorString(state), ncclGetLastError(g.comm));
    g.abort(reason);
    throw CommError(reason);
  }
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclGroup> group, std::shared_ptr<OpState> op) : group_(std::move(group)), op_(std::move(op)) {}

  void wait() override { wait(op_->deadline); }

  void wait(Deadline deadline) override {
    while (!is_completed()) {
      if (deadline.expired()) {
        std::string reason = fmt::format("{} missed its deadline; the communicator is aborted. A rank hung, died, "
                                         "or called a different op; check the other ranks' logs",
                                         group_->describe(op_->op, op_->seq));
        group_->abort(reason);
        throw TimeoutError(reason);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(5));
    }
  }

  void wait_on_stream() override {
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      if (group_->aborted) throw CommError(group_->abort_reason);
    }
    cudaSetDevice(group_->device);
    TILLER_CUDA_OK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(group_->device).stream(), op_->done, 0));
  }

  bool is_completed() override {
    if (op_->complete.load()) return true;
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      if (group_->aborted) throw CommError(group_->abort_reason);
    }
    cudaSetDevice(group_->device);
    cudaError_t q = cudaEventQuery(op_->done);
    if (q == cudaSuccess) {
      op_->complete = true;
      return true;
    }
    if (q != cudaErrorNotReady) {
      std::string reason = fmt::format("{}: CUDA error {}", group_->describe(op_->op, op_->seq), cudaGetErrorString(q));
      group_->abort(reason);
      throw CommError(reason);
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(group_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      std::string reason = fmt::format("{}: NCCL error {}", group_->describe(op_->op, op_->seq), ncclGetErrorString(async));
      group_->abort(reason);
      throw CommError(reason);
    }
    return false;
  }

 private:
  std::shared_ptr<NcclGroup> group_;
  std::shared_ptr<OpState> op_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclGroup> group, double timeout_s) : group_(std::move(group)), timeout_(timeout_s) {
    cudaSetDevice(group_->device);
    TILLER_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TILLER_CUDA_OK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      stop_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
    cudaSetDevice(group_->device);
    bool aborted;
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      aborted = group_->aborted;
    }
    if (!aborted) {
      // Finish what is pending, then release. Bounded: a stuck finalize is aborted.
      try {
        ncclResult_t rc = ncclCommFinalize(group_->comm);
        if (rc == ncclSuccess || rc == ncclInProgress) {
          wait_ready(*group_, fmt::format("destroying communicator '{}'", group_->name), Deadline::after_seconds(timeout_));
        }
        ncclCommDestroy(group_->comm);
      } catch (const std::exception& e) {
        log::error("{}", e.what());
      }
    }
    pending_.clear();
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return group_->rank; }
  int size() const override { return group_->size; }
  const std::string& name() const override { return group_->name; }
  const char* backend() const override { return "nccl"; }
  void set_timeout(double seconds) override { timeout_ = seconds; }
  double timeout() const override { return timeout_; }
  bool aborted() const override {
    std::lock_guard<std::mutex> lock(group_->mu);
    return group_->aborted;
  }

  WorkPtr all_gather(const at::Tensor& input, const at::Tensor& output) override {
    check(input, "all_gather", "input");
    check(output, "all_gather", "output");
    TILLER_CHECK(output.is_contiguous() && output.numel() == input.numel() * size(),
                 "all_gather on '{}': output must be contiguous with {} x {} elements, has {}", name(), size(),
                 input.numel(), output.numel());
    TILLER_CHECK(input.scalar_type() == output.scalar_type(), "all_gather on '{}': input and output dtypes differ", name());
    auto in = input.contiguous();
    return launch("all_gather", {in, output}, [&](cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), output.data_ptr(), in.numel(), nccl_type(in.scalar_type(), false),
                           group_->comm, s);
    });
  }

  WorkPtr reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) override {
    check(input, "reduce_scatter", "input");
    check(output, "reduce_scatter", "output");
    TILLER_CHECK(output.is_contiguous() && input.numel() == output.numel() * size(),
                 "reduce_scatter on '{}': input must have {} x {} elements, has {}", name(), size(), output.numel(),
                 input.numel());
    TILLER_CHECK(input.scalar_type() == output.scalar_type(), "reduce_scatter on '{}': input and output dtypes differ",
                 name());
    auto in = input.contiguous();
    return launch(std::string("reduce_scatter(") + op_name(op) + ")", {in, output}, [&](cudaStream_t s) {
      return ncclReduceScatter(in.data_ptr(), output.data_ptr(), output.numel(), nccl_type(in.scalar_type(), true),
                               nccl_op(op), group_->comm, s);
    });
  }

  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check(tensor, "all_reduce", "tensor");
    TILLER_CHECK(tensor.is_contiguous(), "all_reduce on '{}': the tensor must be contiguous", name());
    return launch(std::string("all_reduce(") + op_name(op) + ")", {tensor}, [&](cudaStream_t s) {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor.scalar_type(), true),
                           nccl_op(op), group_->comm, s);
    });
  }

  WorkPtr broadcast(const at::Tensor& tensor, int root) override {
    check(tensor, "broadcast", "tensor");
    TILLER_CHECK(tensor.is_contiguous(), "broadcast on '{}': the tensor must be contiguous", name());
    TILLER_CHECK(root >= 0 && root < size(), "broadcast on '{}': root {} is not a rank of a group of {}", name(), root,
                 size());
    return launch(fmt::format("broadcast(root {})", root), {tensor}, [&](cudaStream_t s) {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor.scalar_type(), false),
                           root, group_->comm, s);
    });
  }

  WorkPtr send(const at::Tensor& tensor, int peer) override {
    check(tensor, "send", "tensor");
    check_peer(peer, "send");
    auto t = tensor.contiguous();
    return launch(fmt::format("send(to {})", peer), {t}, [&](cudaStream_t s) {
      return ncclSend(t.data_ptr(), t.numel(), nccl_type(t.scalar_type(), false), peer, group_->comm, s);
    });
  }

  WorkPtr recv(const at::Tensor& tensor, int peer) override {
    check(tensor, "recv", "tensor");
    check_peer(peer, "recv");
    TILLER_CHECK(tensor.is_contiguous(), "recv on '{}': the tensor must be contiguous", name());
    return launch(fmt::format("recv(from {})", peer), {tensor}, [&](cudaStream_t s) {
      return ncclRecv(tensor.data_ptr(), tensor.numel(), nccl_type(tensor.scalar_type(), false), peer, group_->comm, s);
    });
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& new_name) override {
    throw_if_aborted("split");
    cudaSetDevice(group_->device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t out = nullptr;
    const std::string what = group_->describe("split", seq_);
    ncclResult_t rc = ncclCommSplit(group_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &out, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      throw CommError(fmt::format("{} failed: {}", what, ncclGetErrorString(rc)));
    }
    wait_ready(*group_, what, Deadline::after_seconds(timeout_));
    if (color < 0 || out == nullptr) return nullptr;
    auto g = std::make_shared<NcclGroup>();
    g->comm = out;
    g->device = group_->device;
    g->name = new_name;
    wait_ready(*g, fmt::format("split of '{}' into '{}'", name(), new_name), Deadline::after_seconds(timeout_));
    ncclCommUserRank(out, &g->rank);
    ncclCommCount(out, &g->size);
    return std::make_unique<NcclCommunicator>(std::move(g), timeout_);
  }

 private:
  void throw_if_aborted(const std::string& op) const {
    std::lock_guard<std::mutex> lock(group_->mu);
    if (group_->aborted) {
      throw CommError(fmt::format("{} on group '{}' (rank {}): the communicator was aborted earlier: {}", op, name(),
                                  rank(), group_->abort_reason));
    }
  }

  void check(const at::Tensor& t, const char* op, const char* what) const {
    TILLER_CHECK(t.defined(), "{} on '{}': {} is undefined", op, name(), what);
    TILLER_CHECK(t.is_cuda() && t.get_device() == group_->device, "{} on '{}' (nccl backend): {} is on {}, expected "
                 "cuda:{}; the NCCL backend takes tensors on its own device", op, name(), what, t.device().str(),
                 group_->device);
  }
  void check_peer(int peer, const char* op) const {
    TILLER_CHECK(peer >= 0 && peer < size() && peer != rank(), "{} on '{}': peer {} is not another rank of a group "
                 "of {}", op, name(), peer, size());
  }

  template <typename Launch>
  WorkPtr launch(const std::string& op, std::vector<at::Tensor> keep, Launch&& call) {
    throw_if_aborted(op);
    auto state = std::make_shared<OpState>();
    state->op = op;
    state->seq = seq_++;
    state->deadline = Deadline::after_seconds(timeout_);
    state->keep = std::move(keep);
    cudaSetDevice(group_->device);
    TILLER_CUDA_OK(cudaEventCreateWithFlags(&state->done, cudaEventDisableTiming));
    // The op runs after everything already queued on the caller's stream.
    cudaStream_t caller = c10::cuda::getCurrentCUDAStream(group_->device).stream();
    TILLER_CUDA_OK(cudaEventRecord(ready_, caller));
    TILLER_CUDA_OK(cudaStreamWaitEvent(stream_, ready_, 0));
    const std::string what = group_->describe(op, state->seq);
    ncclResult_t rc = call(stream_);
    if (rc == ncclInProgress) {
      wait_ready(*group_, what, state->deadline);
    } else if (rc != ncclSuccess) {
      std::string reason = fmt::format("{} failed: {} ({})", what, ncclGetErrorString(rc), ncclGetLastError(group_->comm));
      group_->abort(reason);
      throw CommError(reason);
    }
    TILLER_CUDA_OK(cudaEventRecord(state->done, stream_));
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      pending_.push_back(state);
    }
    return std::make_shared<NcclWork>(group_, state);
  }

  // The watchdog: completes pending ops (releasing their tensors) and aborts on a missed deadline
  // or an async NCCL error, even when nobody waits on the op.
  void watch() {
    cudaSetDevice(group_->device);
    std::unique_lock<std::mutex> lock(watch_mu_);
    while (!stop_) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
      for (auto it = pending_.begin(); it != pending_.end();) {
        auto& s = **it;
        if (s.complete.load() || cudaEventQuery(s.done) == cudaSuccess) {
          s.complete = true;
          it = pending_.erase(it);
          continue;
        }
        if (s.deadline.expired()) {
          group_->abort(fmt::format("watchdog: {} missed its deadline; the communicator is aborted. A rank hung, "
                                    "died, or called a different op; check the other ranks' logs",
                                    group_->describe(s.op, s.seq)));
          pending_.clear();
          break;
        }
        ++it;
      }
      if (!pending_.empty()) {
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(group_->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          group_->abort(fmt::format("watchdog: NCCL error on group '{}' (rank {}): {}", group_->name, group_->rank,
                                    ncclGetErrorString(async)));
          pending_.clear();
        }
      }
    }
  }

  std::shared_ptr<NcclGroup> group_;
  double timeout_;
  std::uint64_t seq_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::list<std::shared_ptr<OpState>> pending_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& over, int device, const std::string& name,
                                                     double timeout_s) {
  TILLER_CHECK(std::string(over.backend()) == "mpi", "NCCL bootstrap for '{}' needs an MPI communicator", name);
  const Deadline deadline = Deadline::after_seconds(timeout_s);
  ncclUniqueId id;
  auto id_bytes = at::zeros({static_cast<std::int64_t>(sizeof(id))}, at::kByte);
  if (over.rank() == 0) {
    ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) throw CommError(fmt::format("ncclGetUniqueId for '{}': {}", name, ncclGetErrorString(rc)));
    std::memcpy(id_bytes.data_ptr(), &id, sizeof(id));
  }
  over.broadcast(id_bytes, 0)->wait(deadline);
  std::memcpy(&id, id_bytes.data_ptr(), sizeof(id));

  auto g = std::make_shared<NcclGroup>();
  g->device = device;
  g->rank = over.rank();
  g->size = over.size();
  g->name = name;
  TILLER_CUDA_OK(cudaSetDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t rc = ncclCommInitRankConfig(&g->comm, g->size, id, g->rank, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    throw CommError(fmt::format("ncclCommInitRankConfig for '{}' (rank {} of {}, cuda:{}): {}", name, g->rank, g->size,
                                device, ncclGetErrorString(rc)));
  }
  wait_ready(*g, fmt::format("creating NCCL communicator '{}' (rank {} of {}, cuda:{})", name, g->rank, g->size, device),
             deadline);
  return std::make_unique<NcclCommunicator>(std::move(g), timeout_s);
}

}  // namespace tiller::dist
