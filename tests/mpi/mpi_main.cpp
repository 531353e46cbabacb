// gtest main for multi-rank tests: every rank runs every test; the exit code is agreed by an
// all-reduce so that one failing rank fails the whole run and no rank is left waiting.
// TILLER_TEST_BACKEND=nccl runs the same tests on NCCL (one GPU per rank), or exits 77 (ctest's
// skip) when this build or machine has no GPUs for it.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#if defined(__linux__) && defined(__x86_64__)
#include <dlfcn.h>
#include <ucontext.h>
#include <unistd.h>
#endif

#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include "mpi_env_for_tests.h"
#include "tiller/core/logging.h"

namespace tiller::test {
MpiTestEnv& mpi_test_env() {
  static MpiTestEnv e;
  return e;
}

namespace {
// On ranks other than 0 the default printer is removed; this prints their failures, with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // The name is kept from OnTestStart: asking UnitTest for the current test from inside
  // OnTestPartResult would take a mutex gtest already holds there, and deadlock.
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
  std::string test_ = "?";
};
#if defined(__linux__) && defined(__x86_64__)
// A crash names where it happened, even a call through a null pointer (which leaves no frame for
// a backtrace): the faulting instruction and the return address on top of the stack, as module +
// offset for addr2line.
void describe(const char* what, uintptr_t addr) {
  Dl_info info{};
  char line[512];
  int n;
  if (addr && dladdr(reinterpret_cast<void*>(addr), &info) && info.dli_fname) {
    n = std::snprintf(line, sizeof line, "  %s: %s(+0x%lx) %s\n", what, info.dli_fname,
                      static_cast<unsigned long>(addr - reinterpret_cast<uintptr_t>(info.dli_fbase)),
                      info.dli_sname ? info.dli_sname : "");
  } else {
    n = std::snprintf(line, sizeof line, "  %s: 0x%lx\n", what, static_cast<unsigned long>(addr));
  }
  if (n > 0) (void)!::write(2, line, static_cast<size_t>(n));
}
void on_crash(int sig, siginfo_t*, void* context) {
  const auto* uc = static_cast<ucontext_t*>(context);
  const uintptr_t rip = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  const uintptr_t rsp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
  (void)!::write(2, "tiller test: fatal signal\n", 26);
  describe("at", rip);
  describe("return address", rsp ? *reinterpret_cast<const uintptr_t*>(rsp) : 0);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
void install_crash_reporter() {
  struct sigaction sa {};
  sa.sa_sigaction = on_crash;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
}
#else
void install_crash_reporter() {}
#endif
}  // namespace
}  // namespace tiller::test

int main(int argc, char** argv) {
  using namespace tiller;
  ::testing::InitGoogleTest(&argc, argv);
  dist::MpiEnv env(&argc, &argv);
  test::install_crash_reporter();  // after MPI_Init, which installs its own handlers
  log::init(env.rank(), "test", log::Level::kWarn);
  const char* b = std::getenv("TILLER_TEST_BACKEND");
  const std::string backend = b ? b : "mpi";
  auto world = env.world(60.0);
  auto& t = test::mpi_test_env();
  t.env = &env;
  t.world = world.get();
  t.comm = world.get();
  t.device = at::TensorOptions();

  std::unique_ptr<dist::Communicator> nccl;
  if (backend == "nccl") {
    const int gpus = at::detail::getCUDAHooks().getNumGPUs();
    const auto pos = env.node_map(0, false, 60.0).local_position(env.rank());
    const int local = pos.index, on_node = pos.ranks_on_node;
    // Agreed by all ranks: skip unless every rank has its own GPU.
    auto ok = at::full({1}, (dist::MpiEnv::have_nccl() && gpus >= on_node) ? 1 : 0, at::kInt);
    world->all_reduce(ok, dist::ReduceOp::kMin)->wait();
    if (ok.item<int>() == 0) {
      if (env.rank() == 0) {
        std::printf("SKIP: NCCL tests need this GPU build and one GPU per rank (have_nccl=%d, %d GPUs for %d ranks)\n",
                    dist::MpiEnv::have_nccl() ? 1 : 0, gpus, on_node);
      }
      return 77;
    }
    nccl = dist::MpiEnv::nccl(*world, local, "world.nccl", 60.0);
    t.comm = nccl.get();
    t.device = at::TensorOptions().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local)));
  }

  if (env.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new test::RankFailurePrinter(env.rank()));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  auto flag = at::full({1}, failed, at::kInt);
  world->all_reduce(flag, dist::ReduceOp::kMax)->wait();
  nccl.reset();
  const int code = flag.item<int>();
  if (env.rank() == 0) std::printf("[rank 0] %s on all ranks\n", code ? "FAILED" : "PASSED");
  return code;
}
