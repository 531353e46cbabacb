#include "mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checks.h"
#include "mpi_check.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/watchdog.h"

namespace tiller::dist {
namespace {

enum class OpKind { kAllGather, kAllToAll, kBroadcast, kReduceScatterSum, kReduceScatterMax, kReduceScatterMin,
                    kAllReduceSum, kAllReduceMax, kAllReduceMin };
constexpr int kOpKinds = 9;
OpKind reduce_kind(OpKind sum_kind, ReduceOp op) {
  return static_cast<OpKind>(static_cast<int>(sum_kind) + static_cast<int>(op));
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

// An MPI datatype of `bytes` contiguous bytes: counts are then element counts, so one message
// carries up to INT_MAX elements rather than INT_MAX bytes.
MPI_Datatype element_type(std::size_t bytes) {
  static std::mutex mu;
  static MPI_Datatype types[17] = {};
  std::lock_guard<std::mutex> lock(mu);
  TILLER_CHECK(bytes >= 1 && bytes <= 16, "unsupported element size {}", bytes);
  if (types[bytes] == 0) {
    MPI_Datatype t = MPI_DATATYPE_NULL;
    TILLER_MPI(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &t), "the MPI type of {}-byte elements", bytes);
    TILLER_MPI(MPI_Type_commit(&t), "the MPI type of {}-byte elements", bytes);
    types[bytes] = t;
  }
  return types[bytes];
}

// Balanced split of n elements over p ranks: the first n % p chunks get one more.
std::int64_t chunk_begin(std::int64_t n, int p, int r) { return r * (n / p) + std::min<std::int64_t>(r, n % p); }
std::int64_t chunk_size(std::int64_t n, int p, int r) { return n / p + (r < n % p ? 1 : 0); }

// Tensors that a message of an aborted operation may still read or write: kept until exit, since
// MPI cannot cancel a send and a late peer could still match it.
void keep_until_exit(std::vector<at::Tensor> tensors) {
  static std::mutex mu;
  static auto* kept = new std::vector<at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  kept->insert(kept->end(), tensors.begin(), tensors.end());
}

// "world ranks 1,2,3" of the ranks of `comm` (the first 16, then how many more), for messages.
std::string world_ranks_text(MPI_Comm comm) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int n = 0;
  if (MPI_Comm_group(comm, &group) != MPI_SUCCESS || MPI_Comm_group(MPI_COMM_WORLD, &world) != MPI_SUCCESS ||
      MPI_Group_size(group, &n) != MPI_SUCCESS)
    return "its group";
  std::vector<int> mine(static_cast<size_t>(n)), in_world(static_cast<size_t>(n), -1);
  for (int i = 0; i < n; ++i) mine[static_cast<size_t>(i)] = i;
  const bool ok = MPI_Group_translate_ranks(group, n, mine.data(), world, in_world.data()) == MPI_SUCCESS;
  (void)MPI_Group_free(&group);
  (void)MPI_Group_free(&world);
  if (!ok) return "its group";
  constexpr int kShown = 16;
  std::vector<int> shown(in_world.begin(), in_world.begin() + std::min(n, kShown));
  return fmt::format("world ranks {}{}", fmt::join(shown, ","), n > kShown ? fmt::format(" and {} more", n - kShown) : "");
}

struct GroupState {
  std::string name;
  int rank = 0;
  int size = 1;
  std::string peers = "its group";  // "world ranks 1,2", for the watchdog's line
  bool aborted = false;
  std::string abort_reason;
};

// A pending message and its peer, so a timeout can say which ranks never answered.
struct Pending {
  MPI_Request request = MPI_REQUEST_NULL;
  int peer = -1;
  bool is_recv = false;
};

// One operation: a sequence of stages, each a set of messages; when a stage's messages are done,
// `advance` runs the local part (a reduction, a copy) and posts the next stage, or returns false.
class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<GroupState> group, std::string op, std::uint64_t seq, Deadline deadline)
      : group_(std::move(group)), op_(std::move(op)), seq_(seq), deadline_(deadline) {}

  ~MpiWork() override {
    if (!done_ && failure_.empty()) {
      // Dropped without waiting: finish it now, so its buffers are not freed under MPI.
      try {
        wait();
      } catch (const std::exception& e) {
        log::error("{}", e.what());
      }
    }
  }

  void add(Pending p, int64_t bytes) {
    pending_.push_back(p);
    bytes_ = std::max(bytes_, bytes);
  }
  std::vector<at::Tensor>& keep() { return keep_; }
  void set_advance(std::function<bool(MpiWork&)> f) { advance_ = std::move(f); }
  void start() { progress(); }

  void wait() override { wait(deadline_); }

  // Polls with a backoff. MPI moves a large message only while some call drives its progress
  // (shared-memory transfers go fragment by fragment), so an op with a message of 1 MiB or more
  // only yields between polls: sleeping there capped the transfer at ~150 MB/s.
  void wait(Deadline deadline) override {
    if (done_ && failure_.empty()) return;
    // Shown by the watchdog; the deadline is this loop's (fail_timeout names the op when it passes).
    WaitScope scope(fmt::format("{} with {}", describe(), group_->peers));
    const auto cap = bytes_ >= (int64_t{1} << 20) ? std::chrono::microseconds(0) : std::chrono::microseconds(500);
    auto backoff = std::chrono::microseconds(0);
    while (!progress()) {
      if (deadline.expired()) fail_timeout(deadline);
      if (backoff.count() == 0) {
        std::this_thread::yield();
        backoff = std::min(std::chrono::microseconds(1), cap);
      } else {
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, cap);
      }
    }
  }

  bool is_completed() override { return progress(); }
  void wait_on_stream() override { wait(); }

  // A post (MPI_Isend, MPI_Irecv) that MPI refused fails the op and aborts the group.
  void check_post(int rc, const char* call, int peer) {
    if (rc != MPI_SUCCESS) fail(fmt::format("{} with rank {} failed: {}", call, peer, mpi_error_text(rc)));
  }

 private:
  // True once complete; throws the failure otherwise recorded.
  bool progress() {
    if (!failure_.empty()) throw CommError(failure_);
    while (!done_) {
      for (auto& p : pending_) {
        if (p.request == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Status status;
        int rc = MPI_Test(&p.request, &flag, &status);
        if (rc != MPI_SUCCESS) fail(fmt::format("MPI_Test of a message with rank {} failed: {}", p.peer, mpi_error_text(rc)));
        if (!flag) return false;
      }
      pending_.clear();
      if (!advance_ || !advance_(*this)) {
        done_ = true;
        keep_.clear();
      }
    }
    return true;
  }

  std::string describe() const {
    return fmt::format("{} #{} on group '{}' (mpi, rank {} of {})", op_, seq_, group_->name, group_->rank,
                       group_->size);
  }

  [[noreturn]] void fail(const std::string& why) {
    abort_group(describe() + ": " + why);
    throw CommError(failure_);
  }

  [[noreturn]] void fail_timeout(Deadline deadline) {
    std::vector<int> silent;
    for (const auto& p : pending_) {
      if (p.request != MPI_REQUEST_NULL && p.is_recv) silent.push_back(p.peer);
    }
    std::sort(silent.begin(), silent.end());
    silent.erase(std::unique(silent.begin(), silent.end()), silent.end());
    std::string who = silent.empty() ? std::string("its peers did not take its data")
                                     : fmt::format("no data from rank(s) {}", fmt::join(silent, ","));
    abort_group(fmt::format("{} missed its deadline ({}); the communicator is aborted. A rank hung, died, or "
                            "called a different op; check those ranks' logs",
                            describe(), who));
    throw TimeoutError(failure_);
  }

  void abort_group(const std::string& reason) {
    failure_ = reason;
    if (!group_->aborted) {
      group_->aborted = true;
      group_->abort_reason = reason;
    }
    for (auto& p : pending_) {
      if (p.request == MPI_REQUEST_NULL) continue;
      // Best effort on a group that is being given up: a failure here changes nothing, as the
      // buffers are kept until exit either way.
      if (p.is_recv) {
        if (MPI_Cancel(&p.request) == MPI_SUCCESS) (void)MPI_Wait(&p.request, MPI_STATUS_IGNORE);
      } else {
        (void)MPI_Request_free(&p.request);
      }
    }
    pending_.clear();
    keep_until_exit(std::move(keep_));
    keep_.clear();
    log::error("{}", reason);
  }

  std::shared_ptr<GroupState> group_;
  std::string op_;
  std::uint64_t seq_;
  Deadline deadline_;
  std::vector<Pending> pending_;
  std::vector<at::Tensor> keep_;
  std::function<bool(MpiWork&)> advance_;
  int64_t bytes_ = 0;  // the largest message posted
  bool done_ = false;
  std::string failure_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm parent, const std::string& name, double timeout_s) : timeout_(timeout_s) {
    // Collective over `parent`; non-blocking duplication, so a missing rank is a timeout.
    MPI_Request requests[2];
    int parent_rank = -1;
    TILLER_MPI(MPI_Comm_rank(parent, &parent_rank), "creating communicator '{}' (mpi)", name);
    TILLER_MPI(MPI_Comm_idup(parent, &coll_, &requests[0]), "creating communicator '{}' (mpi, rank {})", name,
               parent_rank);
    TILLER_MPI(MPI_Comm_idup(parent, &p2p_, &requests[1]), "creating communicator '{}' (mpi, rank {})", name,
               parent_rank);
    const Deadline deadline = Deadline::after_seconds(timeout_s);
    for (int done = 0; !done;) {
      TILLER_MPI(MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE), "creating communicator '{}' (mpi, rank {})",
                 name, parent_rank);
      if (!done && deadline.expired()) {
        const int rank = parent_rank;
        throw TimeoutError(fmt::format("creating communicator '{}' (mpi, rank {}): not every rank joined within {}s; "
                                       "a rank hung or died before it; check the other ranks' logs",
                                       name, rank, timeout_s));
      }
      if (!done) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    group_ = std::make_shared<GroupState>();
    group_->name = name;
    TILLER_MPI(MPI_Comm_rank(coll_, &group_->rank), "communicator '{}' (mpi)", name);
    TILLER_MPI(MPI_Comm_size(coll_, &group_->size), "communicator '{}' (mpi, rank {})", name, group_->rank);
    int flag = 0;
    int* tag_ub = nullptr;
    TILLER_MPI(MPI_Comm_get_attr(coll_, MPI_TAG_UB, &tag_ub, &flag), "communicator '{}' (mpi, rank {})", name,
               group_->rank);
    tag_mod_ = flag && tag_ub ? std::min(*tag_ub, 1 << 30) : 32767;
    send_seq_.assign(group_->size, 0);
    recv_seq_.assign(group_->size, 0);
    group_->peers = world_ranks_text(coll_);
  }

  ~MpiCommunicator() override {
    // An aborted communicator may still have messages in flight; freeing it is then unsafe.
    if (!group_->aborted) {
      for (MPI_Comm* c : {&coll_, &p2p_}) {
        const int rc = MPI_Comm_free(c);
        if (rc != MPI_SUCCESS)  // a destructor does not throw; the process is likely ending anyway
          log::warn("communicator '{}' (mpi, rank {}): MPI_Comm_free failed: {}", group_->name, group_->rank,
                    mpi_error_text(rc));
      }
    }
  }

  int rank() const override { return group_->rank; }
  int size() const override { return group_->size; }
  const std::string& name() const override { return group_->name; }
  const char* backend() const override { return "mpi"; }
  void set_timeout(double seconds) override { timeout_ = seconds; }
  double timeout() const override { return timeout_; }
  bool aborted() const override { return group_->aborted; }
  const std::string& peers() const { return group_->peers; }

  WorkPtr all_gather(const at::Tensor& input, const at::Tensor& output) override {
    auto w = begin("all_gather");
    check_tensor(input, "input", "all_gather");
    check_tensor(output, "output", "all_gather");
    check_same_dtype(input, output, "all_gather");
    const int p = size(), me = rank();
    const std::int64_t n = input.numel();
    TILLER_CHECK(output.numel() == n * p, "all_gather on '{}': output has {} elements, expected {} x {} = {}", name(),
                 output.numel(), p, n, n * p);
    auto in = input.reshape({-1});
    auto out = output.view({-1});
    w->keep() = {in, out};
    const int tag = coll_tag(OpKind::kAllGather, 0);
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      post_recv(*w, out.narrow(0, r * n, n), r, tag, coll_);
      post_send(*w, in, r, tag, coll_);
    }
    out.narrow(0, me * n, n).copy_(in);
    w->start();
    return w;
  }

  WorkPtr all_to_all(const at::Tensor& input, const at::Tensor& output) override {
    auto w = begin("all_to_all");
    check_tensor(input, "input", "all_to_all");
    check_tensor(output, "output", "all_to_all");
    check_same_dtype(input, output, "all_to_all");
    const int p = size(), me = rank();
    TILLER_CHECK(output.is_contiguous() && input.numel() == output.numel() && input.numel() % p == 0,
                 "all_to_all on '{}': input and output must hold the same number of elements, a multiple of {} "
                 "(contiguous output), got {} and {}", name(), p, input.numel(), output.numel());
    const std::int64_t m = input.numel() / p;
    auto in = input.contiguous().view({-1});
    auto out = output.view({-1});
    w->keep() = {in, out};
    const int tag = coll_tag(OpKind::kAllToAll, 0);
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      post_recv(*w, out.narrow(0, r * m, m), r, tag, coll_);
      post_send(*w, in.narrow(0, r * m, m), r, tag, coll_);
    }
    out.narrow(0, me * m, m).copy_(in.narrow(0, me * m, m));
    w->start();
    return w;
  }

  WorkPtr reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) override {
    auto w = begin(std::string("reduce_scatter(") + op_name(op) + ")");
    check_tensor(input, "input", "reduce_scatter");
    check_tensor(output, "output", "reduce_scatter");
    check_same_dtype(input, output, "reduce_scatter");
    const int p = size(), me = rank();
    const std::int64_t m = output.numel();
    TILLER_CHECK(input.numel() == m * p, "reduce_scatter on '{}': input has {} elements, expected {} x {} = {}",
                 name(), input.numel(), p, m, m * p);
    auto in = input.reshape({-1});
    auto out = output.view({-1});
    auto recv = at::empty({m * p}, in.options());
    w->keep() = {in, out, recv};
    const int tag = coll_tag(reduce_kind(OpKind::kReduceScatterSum, op), 0);
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      post_recv(*w, recv.narrow(0, r * m, m), r, tag, coll_);
      post_send(*w, in.narrow(0, r * m, m), r, tag, coll_);
    }
    w->set_advance([in, out, recv, p, me, m, op](MpiWork&) {
      std::vector<at::Tensor> parts;
      for (int r = 0; r < p; ++r) parts.push_back(r == me ? in.narrow(0, me * m, m) : recv.narrow(0, r * m, m));
      out.copy_(reduce_in_rank_order(parts, op));
      return false;
    });
    w->start();
    return w;
  }

  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    auto w = begin(std::string("all_reduce(") + op_name(op) + ")");
    check_tensor(tensor, "tensor", "all_reduce");
    TILLER_CHECK(tensor.is_contiguous(), "all_reduce on '{}': the tensor must be contiguous (it is reduced in place)",
                 name());
    const int p = size(), me = rank();
    auto t = tensor.view({-1});
    const std::int64_t n = t.numel();
    const std::int64_t my_n = chunk_size(n, p, me);
    auto recv = at::empty({my_n * p}, t.options());
    w->keep() = {t, recv};
    // Stage 1: reduce-scatter, rank r owns chunk r. Stage 2: all-gather the reduced chunks.
    const OpKind kind = reduce_kind(OpKind::kAllReduceSum, op);
    const int tag1 = coll_tag(kind, 0), tag2 = coll_tag(kind, 1);
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      post_recv(*w, recv.narrow(0, r * my_n, my_n), r, tag1, coll_);
      post_send(*w, t.narrow(0, chunk_begin(n, p, r), chunk_size(n, p, r)), r, tag1, coll_);
    }
    MPI_Comm comm = coll_;
    w->set_advance([t, recv, p, me, n, my_n, op, tag2, comm, stage = 0](MpiWork& work) mutable {
      if (stage++ > 0) return false;
      auto mine = t.narrow(0, chunk_begin(n, p, me), my_n);
      std::vector<at::Tensor> parts;
      for (int r = 0; r < p; ++r) parts.push_back(r == me ? mine : recv.narrow(0, r * my_n, my_n));
      mine.copy_(reduce_in_rank_order(parts, op));
      for (int r = 0; r < p; ++r) {
        if (r == me) continue;
        post_recv(work, t.narrow(0, chunk_begin(n, p, r), chunk_size(n, p, r)), r, tag2, comm);
        post_send(work, mine, r, tag2, comm);
      }
      return true;
    });
    w->start();
    return w;
  }

  WorkPtr broadcast(const at::Tensor& tensor, int root) override {
    auto w = begin(fmt::format("broadcast(root {})", root));
    check_tensor(tensor, "tensor", "broadcast");
    TILLER_CHECK(root >= 0 && root < size(), "broadcast on '{}': root {} is not a rank of a group of {}", name(), root,
                 size());
    TILLER_CHECK(tensor.is_contiguous(), "broadcast on '{}': the tensor must be contiguous", name());
    auto t = tensor.view({-1});
    w->keep() = {t};
    const int tag = coll_tag(OpKind::kBroadcast, 0);
    if (rank() == root) {
      for (int r = 0; r < size(); ++r) {
        if (r != root) post_send(*w, t, r, tag, coll_);
      }
    } else {
      post_recv(*w, t, root, tag, coll_);
    }
    w->start();
    return w;
  }

  WorkPtr send(const at::Tensor& tensor, int peer) override {
    check_peer(*this, peer, "send");
    auto w = begin_p2p(fmt::format("send(to {})", peer), send_seq_[peer]);
    check_tensor(tensor, "tensor", "send");
    auto t = tensor.contiguous().view({-1});
    w->keep() = {t};
    post_send(*w, t, peer, static_cast<int>(send_seq_[peer]++ % tag_mod_), p2p_);
    w->start();
    return w;
  }

  WorkPtr recv(const at::Tensor& tensor, int peer) override {
    check_peer(*this, peer, "recv");
    auto w = begin_p2p(fmt::format("recv(from {})", peer), recv_seq_[peer]);
    check_tensor(tensor, "tensor", "recv");
    TILLER_CHECK(tensor.is_contiguous(), "recv on '{}': the tensor must be contiguous", name());
    auto t = tensor.view({-1});
    w->keep() = {t};
    post_recv(*w, t, peer, static_cast<int>(recv_seq_[peer]++ % tag_mod_), p2p_);
    w->start();
    return w;
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& new_name) override {
    // Everyone's (color, key) first, under the deadline: after it, every rank is known to be at
    // this split, so the blocking MPI_Comm_split below cannot wait on a missing rank.
    auto mine = at::tensor(std::vector<std::int64_t>{color, key}, at::kLong);
    auto all = at::empty({2 * size()}, at::kLong);
    all_gather(mine, all)->wait();
    MPI_Comm out = MPI_COMM_NULL;
    TILLER_MPI(MPI_Comm_split(coll_, color < 0 ? MPI_UNDEFINED : color, key, &out),
               "splitting group '{}' (mpi, rank {}) into '{}'", name(), rank(), new_name);
    if (out == MPI_COMM_NULL) return nullptr;
    auto comm = std::make_unique<MpiCommunicator>(out, new_name, timeout_);
    TILLER_MPI(MPI_Comm_free(&out), "splitting group '{}' (mpi, rank {}) into '{}'", name(), rank(), new_name);
    return comm;
  }

 private:
  std::shared_ptr<MpiWork> begin(const std::string& op) {
    throw_if_aborted(op);
    return std::make_shared<MpiWork>(group_, op, seq_++, Deadline::after_seconds(timeout_));
  }
  std::shared_ptr<MpiWork> begin_p2p(const std::string& op, std::uint64_t seq) {
    throw_if_aborted(op);
    return std::make_shared<MpiWork>(group_, op, seq, Deadline::after_seconds(timeout_));
  }
  void throw_if_aborted(const std::string& op) const {
    if (group_->aborted) {
      throw CommError(fmt::format("{} on group '{}' (rank {}): the communicator was aborted earlier: {}", op, name(),
                                  rank(), group_->abort_reason));
    }
  }
  // Tag of the current collective (seq_ was already advanced by begin()): its sequence number,
  // its kind and its stage, so that ranks in different collectives never exchange messages; a
  // mismatch becomes a timeout instead of silently mixed data.
  int coll_tag(OpKind kind, int stage) const {
    return static_cast<int>((((seq_ - 1) * kOpKinds + static_cast<int>(kind)) * 2 + stage) % tag_mod_);
  }

  void check_tensor(const at::Tensor& t, const char* what, const char* op) const {
    TILLER_CHECK(t.defined(), "{} on '{}': {} is undefined", op, name(), what);
    TILLER_CHECK(t.device().is_cpu(), "{} on '{}' (mpi backend): {} is on {}; the MPI backend takes CPU tensors, "
                 "use an NCCL communicator for CUDA tensors", op, name(), what, t.device().str());
    TILLER_CHECK(t.numel() < INT_MAX, "{} on '{}': {} has {} elements; the MPI backend moves < 2^31 per message", op,
                 name(), what, t.numel());
  }
  void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op) const {
    TILLER_CHECK(a.scalar_type() == b.scalar_type(), "{} on '{}': input is {} but output is {}", op, name(),
                 c10::toString(a.scalar_type()), c10::toString(b.scalar_type()));
  }

  static void post_send(MpiWork& w, const at::Tensor& t, int peer, int tag, MPI_Comm comm) {
    Pending p{MPI_REQUEST_NULL, peer, false};
    w.check_post(MPI_Isend(t.data_ptr(), static_cast<int>(t.numel()), element_type(t.element_size()), peer, tag, comm,
                           &p.request),
                 "MPI_Isend", peer);
    w.add(p, static_cast<int64_t>(t.nbytes()));
  }
  static void post_recv(MpiWork& w, const at::Tensor& t, int peer, int tag, MPI_Comm comm) {
    Pending p{MPI_REQUEST_NULL, peer, true};
    w.check_post(MPI_Irecv(t.data_ptr(), static_cast<int>(t.numel()), element_type(t.element_size()), peer, tag, comm,
                           &p.request),
                 "MPI_Irecv", peer);
    w.add(p, static_cast<int64_t>(t.nbytes()));
  }

  // The same order on every rank, so every rank gets the same bits. Half types accumulate in fp32.
  static at::Tensor reduce_in_rank_order(const std::vector<at::Tensor>& parts, ReduceOp op) {
    const auto dtype = parts[0].scalar_type();
    const bool widen = op == ReduceOp::kSum && (dtype == at::kBFloat16 || dtype == at::kHalf);
    at::Tensor acc = widen ? parts[0].to(at::kFloat) : parts[0].clone();
    for (std::size_t i = 1; i < parts.size(); ++i) {
      switch (op) {
        case ReduceOp::kSum: acc.add_(parts[i]); break;
        case ReduceOp::kMax: acc = at::maximum(acc, parts[i]); break;
        case ReduceOp::kMin: acc = at::minimum(acc, parts[i]); break;
      }
    }
    return widen ? acc.to(dtype) : acc;
  }

  MPI_Comm coll_ = MPI_COMM_NULL;
  MPI_Comm p2p_ = MPI_COMM_NULL;
  std::shared_ptr<GroupState> group_;
  double timeout_;
  int tag_mod_ = 32767;
  std::uint64_t seq_ = 0;
  std::vector<std::uint64_t> send_seq_;
  std::vector<std::uint64_t> recv_seq_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name, double timeout_s) {
  return std::make_unique<MpiCommunicator>(comm, name, timeout_s);
}

std::string peers_of(const Communicator& comm) {
  const auto* mpi = dynamic_cast<const MpiCommunicator*>(&comm);
  return mpi ? mpi->peers() : std::string("its group");
}

}  // namespace tiller::dist
