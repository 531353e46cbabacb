// The host-staged communicator: CUDA tensors over a CPU (MPI) communicator, for groups that NCCL
// refuses because two of their ranks share a GPU (cluster.ranks_per_gpu > 1). Each operation
// copies its device tensors to the host (a blocking copy, so it follows the work queued on the
// caller's current stream), runs the CPU operation to completion, and copies the result back
// (blocking too, so every stream sees it on return). Slow - host bandwidth, no overlap - and
// correct; the weight sync of a 1-GPU job moves its bytes this way.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/dist/groups.h"

namespace tiller::dist {
namespace {

class DoneWork final : public Work {
 public:
  void wait(Deadline) override {}
  void wait() override {}
  bool is_completed() override { return true; }
  void wait_on_stream() override {}
};

class StagedCommunicator final : public Communicator {
 public:
  explicit StagedCommunicator(std::unique_ptr<Communicator> cpu) : cpu_(std::move(cpu)) {}

  int rank() const override { return cpu_->rank(); }
  int size() const override { return cpu_->size(); }
  const std::string& name() const override { return cpu_->name(); }
  const char* backend() const override { return "mpi-staged"; }
  void set_timeout(double seconds) override { cpu_->set_timeout(seconds); }
  double timeout() const override { return cpu_->timeout(); }

  WorkPtr all_gather(const at::Tensor& input, const at::Tensor& output) override {
    at::Tensor out = host(output, false);
    cpu_->all_gather(host(input, true), out)->wait();
    return back(output, out);
  }
  WorkPtr reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) override {
    at::Tensor out = host(output, false);
    cpu_->reduce_scatter(host(input, true), out, op)->wait();
    return back(output, out);
  }
  WorkPtr all_to_all(const at::Tensor& input, const at::Tensor& output) override {
    at::Tensor out = host(output, false);
    cpu_->all_to_all(host(input, true), out)->wait();
    return back(output, out);
  }
  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    at::Tensor t = host(tensor, true);
    cpu_->all_reduce(t, op)->wait();
    return back(tensor, t);
  }
  WorkPtr broadcast(const at::Tensor& tensor, int root) override {
    at::Tensor t = host(tensor, true);
    cpu_->broadcast(t, root)->wait();
    return back(tensor, t);
  }
  WorkPtr send(const at::Tensor& tensor, int peer) override {
    cpu_->send(host(tensor, true), peer)->wait();
    return std::make_shared<DoneWork>();
  }
  WorkPtr recv(const at::Tensor& tensor, int peer) override {
    at::Tensor t = host(tensor, false);
    cpu_->recv(t, peer)->wait();
    return back(tensor, t);
  }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    auto inner = cpu_->split(color, key, name);
    if (!inner) return nullptr;
    return std::make_unique<StagedCommunicator>(std::move(inner));
  }
  bool aborted() const override { return cpu_->aborted(); }

 private:
  // The host tensor an op runs on: `t` itself when it is on the CPU, else a contiguous host copy
  // (with `t`'s contents when `copy`, else uninitialised).
  static at::Tensor host(const at::Tensor& t, bool copy) {
    if (t.device().is_cpu()) return t;
    return copy ? t.to(at::kCPU).contiguous() : at::empty(t.sizes(), t.options().device(at::kCPU));
  }
  static WorkPtr back(const at::Tensor& dst, const at::Tensor& src) {
    if (!dst.device().is_cpu()) dst.copy_(src);  // from pageable memory: blocking
    return std::make_shared<DoneWork>();
  }

  std::unique_ptr<Communicator> cpu_;
};

}  // namespace

std::unique_ptr<Communicator> host_staged(std::unique_ptr<Communicator> cpu) {
  TILLER_CHECK(cpu != nullptr, "host_staged: no communicator");
  return std::make_unique<StagedCommunicator>(std::move(cpu));
}

bool shares_a_device(Communicator& group, int64_t node, int64_t device) {
  const at::Tensor mine = at::tensor({node, device}, at::kLong);
  const at::Tensor all = at::empty({2 * group.size()}, at::kLong);
  group.all_gather(mine, all)->wait();
  const int64_t* p = all.data_ptr<int64_t>();
  for (int i = 0; i < group.size(); ++i)
    for (int j = i + 1; j < group.size(); ++j)
      if (p[2 * i] == p[2 * j] && p[2 * i + 1] == p[2 * j + 1]) return true;
  return false;
}

}  // namespace tiller::dist
