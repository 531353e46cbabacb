#include "nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>

#include "checks.h"
#include "dist/call_failure.h"
#include "dist/launcher.h"
#include "mpi_communicator.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/watchdog.h"

namespace tiller::dist {
namespace {

// TILLER_CUDA(call, "context {}", args...) and TILLER_NCCL(call, ...): a failing call throws
// CommError "<context>: <call> failed: <the library's words>", the context naming the op, group and
// rank (NcclGroup::describe). Every CUDA and NCCL call of this file goes through one of them, or
// through check_on_launcher() where a throw would end the launcher thread.
#define TILLER_CUDA(call, ...)                                                                        \
  do {                                                                                                \
    const cudaError_t tiller_cuda_rc_ = (call);                                                       \
    if (tiller_cuda_rc_ != cudaSuccess)                                                               \
      throw CommError(call_failure(::fmt::format(__VA_ARGS__), #call, cudaGetErrorString(tiller_cuda_rc_))); \
  } while (0)
#define TILLER_NCCL(call, ...)                                                                        \
  do {                                                                                                \
    const ncclResult_t tiller_nccl_rc_ = (call);                                                      \
    if (tiller_nccl_rc_ != ncclSuccess)                                                               \
      throw CommError(call_failure(::fmt::format(__VA_ARGS__), #call, ncclGetErrorString(tiller_nccl_rc_))); \
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

using EventPool = HandlePool<cudaEvent_t>;

// Events are reused: creating two per op costs host time on every collective.
std::shared_ptr<EventPool> make_event_pool(int device) {
  return std::make_shared<EventPool>(
      [device] {
        cudaEvent_t e = nullptr;
        TILLER_CUDA(cudaSetDevice(device), "an event for cuda:{}", device);
        TILLER_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "an event for cuda:{}", device);
        return e;
      },
      [](cudaEvent_t e) { (void)cudaEventDestroy(e); });  // at teardown, with nothing left to report to
}

// Shared by the communicator, its Works, its launcher jobs and the watchdog.
struct NcclGroup {
  ncclComm_t comm = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  std::string name;
  std::string peers = "its group";  // "world ranks 1,2" (the watchdog's line)
  std::timed_mutex nccl_mu;  // held around every NCCL call on `comm` (launcher, abort, async-error poll)
  std::mutex mu;             // guards aborted and abort_reason
  bool aborted = false;
  std::string abort_reason;

  std::string describe(const std::string& op, std::uint64_t seq) const {
    return fmt::format("{} #{} on group '{}' (nccl, rank {} of {}, cuda:{})", op, seq, name, rank, size, device);
  }
  bool is_aborted() {
    std::lock_guard<std::mutex> lock(mu);
    return aborted;
  }
  std::string reason() {
    std::lock_guard<std::mutex> lock(mu);
    return abort_reason;
  }
  // Records the first reason and aborts the NCCL communicator, freeing kernels stuck in it. If a
  // launcher is stuck inside an NCCL call, NCCL must not be torn down under it: that is logged.
  void abort(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (aborted) return;
      aborted = true;
      abort_reason = why;
    }
    log::error("{}", why);
    std::unique_lock<std::timed_mutex> lock(nccl_mu, std::chrono::seconds(1));
    if (!lock.owns_lock()) {
      log::error("communicator '{}' (rank {}) is stuck inside an NCCL call on the host; not aborting it under the "
                 "call. Exit the process so mpirun tears the job down",
                 name, rank);
      return;
    }
    if (comm != nullptr) {
      // Already failing: a second failure is logged, not thrown over the first.
      if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
        log::error("{}", call_failure(fmt::format("aborting group '{}' (rank {})", name, rank), "cudaSetDevice",
                                      cudaGetErrorString(e)));
      if (const ncclResult_t r = ncclCommAbort(comm); r != ncclSuccess)
        log::error("{}", call_failure(fmt::format("aborting group '{}' (rank {})", name, rank), "ncclCommAbort",
                                      ncclGetErrorString(r)));
      comm = nullptr;
    }
  }
};

struct OpState final : OpTicket {
  std::shared_ptr<EventPool> events;
  cudaEvent_t ready = nullptr;  // recorded on the caller's stream at issue
  cudaEvent_t done = nullptr;   // recorded on the communicator's stream after the NCCL call
  // Alive until the op is on the communicator's stream; from then on the caching allocator keeps
  // their memory from reuse until the stream passes the op (recordStream at issue). Holding them
  // until completion instead would keep every buffer until the watchdog's next poll (100 ms):
  // gigabytes of gathered units and gradient buffers in a ZeRO-3 step.
  std::vector<at::Tensor> keep;
  ~OpState() override {
    // Events of an op that never completed (aborted) may still be referenced by the GPU.
    for (cudaEvent_t e : {ready, done}) {
      if (e == nullptr) continue;
      if (complete.load()) events->give(e);
      else events->discard(e);
    }
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclGroup> group, std::shared_ptr<OpState> op) : group_(std::move(group)), op_(std::move(op)) {}

  void wait() override { wait(op_->deadline); }

  void wait(Deadline deadline) override {
    if (op_->complete.load()) return;
    // Shown by the watchdog; the deadline is this op's (time_out names it).
    WaitScope scope(fmt::format("{} with {}", group_->describe(op_->op, op_->seq), group_->peers));
    poll_until([this] { return is_completed(); }, deadline, [this] { time_out(); });
  }

  void wait_on_stream() override {
    // The completion event exists once the launcher has made the NCCL call.
    poll_until([this] { return launched(); }, op_->deadline, [this] { time_out(); });
    const std::string what = group_->describe(op_->op, op_->seq);
    TILLER_CUDA(cudaSetDevice(group_->device), "{}", what);
    TILLER_CUDA(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(group_->device).stream(), op_->done, 0), "{}",
                what);
  }

  bool is_completed() override {
    if (op_->complete.load()) return true;
    if (!launched()) return false;
    TILLER_CUDA(cudaSetDevice(group_->device), "{}", group_->describe(op_->op, op_->seq));
    cudaError_t q = cudaEventQuery(op_->done);
    if (q == cudaSuccess) {
      op_->complete = true;
      return true;
    }
    if (q != cudaErrorNotReady) {
      std::string why = call_failure(group_->describe(op_->op, op_->seq), "cudaEventQuery", cudaGetErrorString(q));
      group_->abort(why);
      throw CommError(why);
    }
    if (group_->is_aborted()) throw CommError(group_->reason());
    return false;
  }

 private:
  // True once the NCCL call was made; throws if it failed or the communicator was aborted.
  bool launched() {
    const int phase = op_->phase.load();
    if (phase == kFailed) throw CommError(op_->error);
    if (phase == kQueued && group_->is_aborted()) throw CommError(group_->reason());
    return phase == kLaunched;
  }
  [[noreturn]] void time_out() {
    std::string why = fmt::format("{} missed its deadline{}; the communicator is aborted. A rank hung, died, or called "
                                  "a different op; check the other ranks' logs",
                                  group_->describe(op_->op, op_->seq),
                                  op_->phase.load() == kQueued ? " (stuck before NCCL enqueued it)" : "");
    group_->abort(why);
    throw TimeoutError(group_->reason() == why ? why : why + " (first: " + group_->reason() + ")");
  }

  std::shared_ptr<NcclGroup> group_;
  std::shared_ptr<OpState> op_;
};

ncclConfig_t blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;  // calls run on the launcher thread, which may block
  return config;
}

// Runs `call` (an NCCL call returning ncclResult_t) on `launcher` and waits for it until
// `deadline`. On a miss the launcher is presumed stuck inside NCCL: the group is marked aborted
// and TimeoutError says so. Everything the job touches is owned by the job.
template <typename Call>
void run_on_launcher(Launcher& launcher, const std::shared_ptr<NcclGroup>& group, const std::string& what,
                     Deadline deadline, Call call) {
  struct Result {
    std::atomic<bool> done{false};
    ncclResult_t rc = ncclSuccess;
    std::string cuda_error;
  };
  auto result = std::make_shared<Result>();
  launcher.post([result, group, call]() mutable {
    std::lock_guard<std::timed_mutex> lock(group->nccl_mu);
    if (const cudaError_t e = cudaSetDevice(group->device); e != cudaSuccess) {
      result->cuda_error = call_failure("", "cudaSetDevice", cudaGetErrorString(e));
    } else {
      result->rc = call();
    }
    result->done = true;
  });
  poll_until([&] { return result->done.load(); }, deadline, [&] {
    const std::string why = fmt::format("{} missed its deadline: a rank did not join or NCCL is stuck on the host; "
                                        "the communicator is unusable and the process must exit",
                                        what);
    {
      std::lock_guard<std::mutex> lock(group->mu);
      if (!group->aborted) {
        group->aborted = true;
        group->abort_reason = why;
      }
    }
    launcher.abandon();
    log::error("{}", why);
    throw TimeoutError(why);
  });
  if (!result->cuda_error.empty()) throw CommError(what + result->cuda_error);
  if (result->rc != ncclSuccess) throw CommError(fmt::format("{} failed: {}", what, ncclGetErrorString(result->rc)));
}

class NcclCommunicator final : public Communicator {
 public:
  // Takes a group whose comm is not yet created: `create` makes it on the launcher thread, by
  // `create_deadline`. Ops get timeout_s each.
  template <typename Create>
  NcclCommunicator(std::shared_ptr<NcclGroup> group, double timeout_s, const std::string& what,
                   Deadline create_deadline, Create create)
      : group_(std::move(group)), timeout_(timeout_s) {
    events_ = make_event_pool(group_->device);
    launcher_ = std::make_unique<Launcher>();
    run_on_launcher(*launcher_, group_, what, create_deadline, create);
    TILLER_CUDA(cudaSetDevice(group_->device), "{}", what);
    TILLER_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "{}", what);
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      stop_ = true;
    }
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (!group_->is_aborted()) {
      // Finish what is pending, then release; bounded, a stuck one is abandoned.
      try {
        NcclGroup* g = group_.get();
        run_on_launcher(*launcher_, group_, fmt::format("destroying communicator '{}'", g->name),
                        Deadline::after_seconds(timeout_), [g] {
                          ncclResult_t rc = ncclCommFinalize(g->comm);
                          if (rc == ncclSuccess) rc = ncclCommDestroy(g->comm);
                          g->comm = nullptr;
                          return rc;
                        });
      } catch (const std::exception& e) {
        log::error("{}", e.what());
      }
    }
    // After an abort the launcher may be stuck inside NCCL, using the stream: leave both.
    const bool stuck = group_->is_aborted();
    if (stuck) launcher_->abandon();
    launcher_.reset();
    watch_.clear();
    if (stream_ != nullptr && !stuck) {
      if (const cudaError_t e = cudaStreamDestroy(stream_); e != cudaSuccess)  // a destructor logs
        log::warn("{}", call_failure(fmt::format("destroying communicator '{}'", group_->name), "cudaStreamDestroy",
                                     cudaGetErrorString(e)));
    }
  }

  int rank() const override { return group_->rank; }
  int size() const override { return group_->size; }
  const std::string& name() const override { return group_->name; }
  const char* backend() const override { return "nccl"; }
  void set_timeout(double seconds) override { timeout_ = seconds; }
  double timeout() const override { return timeout_; }
  bool aborted() const override { return group_->is_aborted(); }

  WorkPtr all_gather(const at::Tensor& input, const at::Tensor& output) override {
    check(input, "all_gather", "input");
    check(output, "all_gather", "output");
    TILLER_CHECK(output.is_contiguous() && output.numel() == input.numel() * size(),
                 "all_gather on '{}': output must be contiguous with {} x {} elements, has {}", name(), size(),
                 input.numel(), output.numel());
    TILLER_CHECK(input.scalar_type() == output.scalar_type(), "all_gather on '{}': input and output dtypes differ", name());
    auto in = input.contiguous();
    const auto type = nccl_type(in.scalar_type(), false);
    return launch("all_gather", {in, output}, [in = in.data_ptr(), out = output.data_ptr(), n = in.numel(), type](
                                                  ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(in, out, n, type, c, s);
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
    const auto type = nccl_type(in.scalar_type(), true);
    return launch(std::string("reduce_scatter(") + op_name(op) + ")", {in, output},
                  [in = in.data_ptr(), out = output.data_ptr(), n = output.numel(), type, r = nccl_op(op)](
                      ncclComm_t c, cudaStream_t s) { return ncclReduceScatter(in, out, n, type, r, c, s); });
  }

  WorkPtr all_to_all(const at::Tensor& input, const at::Tensor& output) override {
    check(input, "all_to_all", "input");
    check(output, "all_to_all", "output");
    TILLER_CHECK(output.is_contiguous() && input.numel() == output.numel() && input.numel() % size() == 0,
                 "all_to_all on '{}': input and output must hold the same number of elements, a multiple of {} "
                 "(contiguous output), got {} and {}", name(), size(), input.numel(), output.numel());
    TILLER_CHECK(input.scalar_type() == output.scalar_type(), "all_to_all on '{}': input and output dtypes differ", name());
    auto in = input.contiguous();
    const auto type = nccl_type(in.scalar_type(), false);
    const size_t chunk_bytes = static_cast<size_t>(in.numel() / size()) * in.element_size();
    // NCCL has no all-to-all: one group of sends and receives, which NCCL runs as one operation.
    return launch("all_to_all", {in, output},
                  [in = static_cast<const char*>(in.data_ptr()), out = static_cast<char*>(output.data_ptr()),
                   n = in.numel() / size(), p = size(), chunk_bytes, type](ncclComm_t c, cudaStream_t s) {
                    ncclResult_t rc = ncclGroupStart();
                    for (int r = 0; r < p && rc == ncclSuccess; ++r) {
                      rc = ncclSend(in + r * chunk_bytes, n, type, r, c, s);
                      if (rc == ncclSuccess) rc = ncclRecv(out + r * chunk_bytes, n, type, r, c, s);
                    }
                    const ncclResult_t end = ncclGroupEnd();
                    return rc != ncclSuccess ? rc : end;
                  });
  }

  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check(tensor, "all_reduce", "tensor");
    TILLER_CHECK(tensor.is_contiguous(), "all_reduce on '{}': the tensor must be contiguous", name());
    const auto type = nccl_type(tensor.scalar_type(), true);
    return launch(std::string("all_reduce(") + op_name(op) + ")", {tensor},
                  [p = tensor.data_ptr(), n = tensor.numel(), type, r = nccl_op(op)](ncclComm_t c, cudaStream_t s) {
                    return ncclAllReduce(p, p, n, type, r, c, s);
                  });
  }

  WorkPtr broadcast(const at::Tensor& tensor, int root) override {
    check(tensor, "broadcast", "tensor");
    TILLER_CHECK(tensor.is_contiguous(), "broadcast on '{}': the tensor must be contiguous", name());
    TILLER_CHECK(root >= 0 && root < size(), "broadcast on '{}': root {} is not a rank of a group of {}", name(), root,
                 size());
    const auto type = nccl_type(tensor.scalar_type(), false);
    return launch(fmt::format("broadcast(root {})", root), {tensor},
                  [p = tensor.data_ptr(), n = tensor.numel(), type, root](ncclComm_t c, cudaStream_t s) {
                    return ncclBroadcast(p, p, n, type, root, c, s);
                  });
  }

  WorkPtr send(const at::Tensor& tensor, int peer) override {
    check(tensor, "send", "tensor");
    check_peer(*this, peer, "send");
    auto t = tensor.contiguous();
    const auto type = nccl_type(t.scalar_type(), false);
    return launch(fmt::format("send(to {})", peer), {t},
                  [p = t.data_ptr(), n = t.numel(), type, peer](ncclComm_t c, cudaStream_t s) {
                    return ncclSend(p, n, type, peer, c, s);
                  });
  }

  WorkPtr recv(const at::Tensor& tensor, int peer) override {
    check(tensor, "recv", "tensor");
    check_peer(*this, peer, "recv");
    TILLER_CHECK(tensor.is_contiguous(), "recv on '{}': the tensor must be contiguous", name());
    const auto type = nccl_type(tensor.scalar_type(), false);
    return launch(fmt::format("recv(from {})", peer), {tensor},
                  [p = tensor.data_ptr(), n = tensor.numel(), type, peer](ncclComm_t c, cudaStream_t s) {
                    return ncclRecv(p, n, type, peer, c, s);
                  });
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& new_name) override {
    throw_if_aborted("split");
    const std::string what = group_->describe("split into '" + new_name + "'", seq_++);
    auto child = std::make_shared<NcclGroup>();
    child->device = group_->device;
    child->name = new_name;
    // The split runs on this communicator's launcher (it is a call on the parent), in order
    // with the ops already queued.
    auto out = std::make_shared<ncclComm_t>(nullptr);
    const Deadline deadline = Deadline::after_seconds(timeout_);
    NcclGroup* parent = group_.get();
    run_on_launcher(*launcher_, group_, what, deadline, [parent, color, key, out] {
      if (parent->comm == nullptr) return ncclInvalidUsage;
      ncclConfig_t config = blocking_config();
      return ncclCommSplit(parent->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, out.get(), &config);
    });
    if (color < 0 || *out == nullptr) return nullptr;
    NcclGroup* c = child.get();
    return std::make_unique<NcclCommunicator>(child, timeout_, what, deadline, [c, comm = *out] {
      c->comm = comm;
      ncclResult_t rc = ncclCommUserRank(comm, &c->rank);
      if (rc == ncclSuccess) rc = ncclCommCount(comm, &c->size);
      return rc;
    });
  }

 private:
  void throw_if_aborted(const std::string& op) const {
    if (group_->is_aborted()) {
      throw CommError(fmt::format("{} on group '{}' (rank {}): the communicator was aborted earlier: {}", op, name(),
                                  rank(), group_->reason()));
    }
  }

  void check(const at::Tensor& t, const char* op, const char* what) const {
    TILLER_CHECK(t.defined(), "{} on '{}': {} is undefined", op, name(), what);
    TILLER_CHECK(t.is_cuda() && t.get_device() == group_->device, "{} on '{}' (nccl backend): {} is on {}, expected "
                 "cuda:{}; the NCCL backend takes tensors on its own device", op, name(), what, t.device().str(),
                 group_->device);
  }

  // Queues `call(comm, stream)` on the launcher, ordered after the work already on the caller's
  // current stream.
  template <typename Call>
  WorkPtr launch(const std::string& op, std::vector<at::Tensor> keep, Call&& call) {
    throw_if_aborted(op);
    auto state = std::make_shared<OpState>();
    state->op = op;
    state->seq = seq_++;
    state->deadline = Deadline::after_seconds(timeout_);
    const auto comm_stream = c10::cuda::getStreamFromExternal(stream_, static_cast<c10::DeviceIndex>(group_->device));
    for (const auto& t : keep)
      if (t.defined() && t.is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), comm_stream);
    state->keep = std::move(keep);
    state->events = events_;
    state->ready = events_->take();
    state->done = events_->take();
    const std::string what = group_->describe(op, state->seq);
    TILLER_CUDA(cudaSetDevice(group_->device), "{}", what);
    TILLER_CUDA(cudaEventRecord(state->ready, c10::cuda::getCurrentCUDAStream(group_->device).stream()), "{}", what);
    watch_.add(state);
    launcher_->post([g = group_, state, stream = stream_, call = std::forward<Call>(call)]() mutable {
      std::lock_guard<std::timed_mutex> lock(g->nccl_mu);
      if (g->comm == nullptr || g->is_aborted()) {
        state->error = g->describe(state->op, state->seq) + ": the communicator was aborted: " + g->reason();
        state->keep.clear();
        state->phase = kFailed;
        return;
      }
      // On the launcher thread a failure is recorded in the op (its waiters throw it), not thrown.
      auto failed = [&](const char* call_name, const std::string& why) {
        state->error = call_failure(g->describe(state->op, state->seq), call_name, why);
        state->keep.clear();
        state->phase = kFailed;
      };
      if (const cudaError_t e = cudaSetDevice(g->device); e != cudaSuccess)
        return failed("cudaSetDevice", cudaGetErrorString(e));
      if (const cudaError_t e = cudaStreamWaitEvent(stream, state->ready, 0); e != cudaSuccess)
        return failed("cudaStreamWaitEvent", cudaGetErrorString(e));
      if (const ncclResult_t rc = call(g->comm, stream); rc != ncclSuccess)
        return failed("the NCCL call", fmt::format("{} ({})", ncclGetErrorString(rc), ncclGetLastError(g->comm)));
      if (const cudaError_t e = cudaEventRecord(state->done, stream); e != cudaSuccess)
        return failed("cudaEventRecord", cudaGetErrorString(e));
      state->keep.clear();  // on the stream now: recordStream protects the memory
      state->phase = kLaunched;
    });
    return std::make_shared<NcclWork>(group_, state);
  }

  // The watchdog: completes pending ops (releasing their tensors) and aborts on a missed deadline
  // or an async NCCL error, even when nobody waits on the op.
  void watch() {
    if (const cudaError_t e = cudaSetDevice(group_->device); e != cudaSuccess) {
      group_->abort(call_failure(fmt::format("watchdog of group '{}' (rank {})", group_->name, group_->rank),
                                 "cudaSetDevice", cudaGetErrorString(e)));
      return;
    }
    std::unique_lock<std::mutex> lock(watch_mu_);
    while (!stop_) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
      lock.unlock();
      const auto late = watch_.sweep([](OpTicket& t) {
        return cudaEventQuery(static_cast<OpState&>(t).done) == cudaSuccess;
      });
      if (late) {
        group_->abort(fmt::format("watchdog: {} missed its deadline; the communicator is aborted. A rank hung, "
                                  "died, or called a different op; check the other ranks' logs",
                                  group_->describe(late->op, late->seq)));
      } else if (watch_.size() > 0 && !group_->is_aborted()) {
        ncclResult_t async = ncclSuccess;
        ncclResult_t polled = ncclSuccess;
        {
          std::unique_lock<std::timed_mutex> nccl(group_->nccl_mu, std::try_to_lock);
          if (nccl.owns_lock() && group_->comm != nullptr) polled = ncclCommGetAsyncError(group_->comm, &async);
        }
        if (polled != ncclSuccess) async = polled;
        if (async != ncclSuccess && async != ncclInProgress) {
          group_->abort(call_failure(fmt::format("watchdog of group '{}' (rank {})", group_->name, group_->rank),
                                     "ncclCommGetAsyncError", ncclGetErrorString(async)));
          watch_.clear();
        }
      }
      lock.lock();
    }
  }

  std::shared_ptr<NcclGroup> group_;
  double timeout_;
  std::uint64_t seq_ = 0;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<EventPool> events_;  // shared with pending ops, which may outlive this
  std::unique_ptr<Launcher> launcher_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  OpWatch watch_;  // ops in flight
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
    if (rc != ncclSuccess)
      throw CommError(call_failure(fmt::format("creating NCCL communicator '{}'", name), "ncclGetUniqueId",
                                   ncclGetErrorString(rc)));
    std::memcpy(id_bytes.data_ptr(), &id, sizeof(id));
  }
  over.broadcast(id_bytes, 0)->wait(deadline);
  std::memcpy(&id, id_bytes.data_ptr(), sizeof(id));

  auto g = std::make_shared<NcclGroup>();
  g->device = device;
  g->rank = over.rank();
  g->size = over.size();
  g->name = name;
  g->peers = peers_of(over);
  const std::string what = fmt::format("creating NCCL communicator '{}' (rank {} of {}, cuda:{})", name, g->rank,
                                       g->size, device);
  NcclGroup* raw = g.get();  // the job is owned by the launcher, which shares ownership of g
  return std::make_unique<NcclCommunicator>(g, timeout_s, what, deadline, [raw, id] {
    ncclConfig_t config = blocking_config();
    return ncclCommInitRankConfig(&raw->comm, raw->size, id, raw->rank, &config);
  });
}

}  // namespace tiller::dist
