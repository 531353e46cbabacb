#include "tiller/dist/mpi_env.h"

#include <mpi.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <fmt/format.h>

#include "mpi_check.h"
#include "mpi_communicator.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/watchdog.h"

namespace tiller::dist {
namespace {
std::atomic<bool> g_alive{false};
constexpr int kHostBytes = 64;
}  // namespace

MpiEnv::MpiEnv(int* argc, char*** argv) {
  TILLER_CHECK(!g_alive.exchange(true), "MpiEnv created twice; create one at the start of main");
  int initialized = 0;
  TILLER_MPI(MPI_Initialized(&initialized), "starting MPI");
  TILLER_CHECK(!initialized, "MPI was already initialised outside tiller::dist::MpiEnv");
  int provided = 0;
  // Before MPI_Init the default handler aborts on errors; a code that comes back is still checked.
  TILLER_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "starting MPI");
  if (provided < MPI_THREAD_FUNNELED) {
    (void)MPI_Finalize();
    throw CommError(fmt::format("the MPI library gives thread level {}; tiller needs at least MPI_THREAD_FUNNELED",
                                provided));
  }
  // Errors come back as return codes, which tiller turns into CommError with context.
  TILLER_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "starting MPI");
  TILLER_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "starting MPI");
  TILLER_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size_), "starting MPI (rank {})", rank_);
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  TILLER_MPI(MPI_Get_processor_name(host, &len), "starting MPI (rank {})", rank_);
  hostname_.assign(host, len);
}

MpiEnv::~MpiEnv() {
  // Unwinding from an error: other ranks may be inside a collective, where MPI_Finalize could wait
  // for them forever. Leave MPI as it is; when this process exits without finalizing, mpirun
  // tears the whole job down, which is what an error should do.
  if (std::uncaught_exceptions() == 0) {
    Watchdog::stop();  // no deadline is checked once MPI is gone
    int finalized = 1;
    if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) {
      const int rc = MPI_Finalize();
      if (rc != MPI_SUCCESS) log::warn("rank {}: MPI_Finalize failed: {}", rank_, mpi_error_text(rc));
    }
  }
  g_alive = false;
}

NodeMap MpiEnv::node_map(int gpus_per_node, bool cpu_run, double timeout_s) const {
  auto world_comm = world(timeout_s);
  // Everyone alive and here first (bounded), then the node split (blocking, but all ranks are at it).
  auto ping = at::zeros({1}, at::kInt);
  world_comm->all_reduce(ping)->wait();
  MPI_Comm node_comm = MPI_COMM_NULL;
  const char* what = "finding the ranks of each node (rank {})";
  TILLER_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_comm),
             fmt::runtime(what), rank_);
  // The node's id is its lowest world rank: node-comm rank 0 (keys are world ranks).
  MPI_Group node_group, world_group;
  TILLER_MPI(MPI_Comm_group(node_comm, &node_group), fmt::runtime(what), rank_);
  TILLER_MPI(MPI_Comm_group(MPI_COMM_WORLD, &world_group), fmt::runtime(what), rank_);
  int zero = 0, leader = -1;
  TILLER_MPI(MPI_Group_translate_ranks(node_group, 1, &zero, world_group, &leader), fmt::runtime(what), rank_);
  TILLER_MPI(MPI_Group_free(&node_group), fmt::runtime(what), rank_);
  TILLER_MPI(MPI_Group_free(&world_group), fmt::runtime(what), rank_);
  TILLER_MPI(MPI_Comm_free(&node_comm), fmt::runtime(what), rank_);

  int gpus = -1;
  if (!cpu_run) gpus = gpus_per_node > 0 ? gpus_per_node : at::detail::getCUDAHooks().getNumGPUs();
  // Per rank: leader, gpus, then the host name in kHostBytes bytes.
  constexpr int kInts = 2 + kHostBytes / 4;
  auto mine = at::zeros({kInts}, at::kInt);
  mine[0] = leader;
  mine[1] = gpus;
  std::memcpy(mine.data_ptr<int>() + 2, hostname_.data(), std::min<std::size_t>(hostname_.size(), kHostBytes - 1));
  auto all = at::empty({kInts * size_}, at::kInt);
  world_comm->all_gather(mine, all)->wait();

  std::map<int, NodeMap::Node> by_leader;
  for (int r = 0; r < size_; ++r) {
    const int* row = all.data_ptr<int>() + r * kInts;
    auto& node = by_leader[row[0]];
    node.ranks.push_back(r);
    node.gpus = row[1];
    node.host = std::string(reinterpret_cast<const char*>(row + 2));
  }
  NodeMap map;
  for (auto& [leader_rank, node] : by_leader) map.nodes.push_back(std::move(node));
  return map;
}

void MpiEnv::once_per_node(const std::function<void()>& work, const std::string& what, double timeout_s) const {
  const NodeMap nodes = node_map(0, /*cpu_run=*/true, timeout_s);
  if (nodes.local_position(rank_).index == 0) work();
  auto world_comm = world(timeout_s);
  auto done = at::zeros({1}, at::kInt);
  try {
    world_comm->all_reduce(done)->wait();
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{} did not end within {} s on every node (the lowest rank of each node runs it; "
                                   "check their logs): {}", what, timeout_s, e.what()));
  }
}

std::unique_ptr<Communicator> MpiEnv::world(double timeout_s) const {
  return make_mpi_communicator(MPI_COMM_WORLD, "world", timeout_s);
}

void MpiEnv::abort_job(int code) {
  // On the way out: nothing to report a failure to but the exit code itself.
  int initialized = 0, finalized = 1;
  if (MPI_Initialized(&initialized) == MPI_SUCCESS && MPI_Finalized(&finalized) == MPI_SUCCESS && initialized &&
      !finalized)
    (void)MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void MpiEnv::fail_job(int rank, const std::exception& e) {
  if (Watchdog::running()) Watchdog::end_job(exit_code_for(e), error_line(e));
  std::fprintf(stderr, "tiller: error: rank %d: %s\n", rank, error_line(e).c_str());
  std::fflush(stderr);
  abort_job(exit_code_for(e));
}

}  // namespace tiller::dist
