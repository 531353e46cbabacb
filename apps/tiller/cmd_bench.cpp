// tiller bench collectives: bus bandwidth of all_gather, reduce_scatter and broadcast through
// tiller's Communicator, measured the way nccl-tests and ../shared/bench/peer_bench.py do
// (warm-up, then the mean of back-to-back ops, host-timed until the last completes), so the two
// can be compared in one run. Reports the slowest rank's time and rank 0's (the peer's
// definition), and the host time to issue one op. Prints one JSON object on rank 0.
#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <fstream>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "tiller/model/numerics.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/mpi_env.h"

namespace tiller::cli {
namespace {

struct BenchOptions {
  std::vector<int> sizes_mb{64, 128, 256, 512, 1024};
  int warmup = 3;
  int iters = 10;
  std::string backend = "auto";
  std::string dtype = "bf16";
  double timeout_s = 120;
  std::string out;
};

int run_collectives(const BenchOptions& o, int* argc, char*** argv) {
  dist::MpiEnv env(argc, argv);
  log::init(env.rank(), "bench", log::Level::kInfo);
  RankComm bc = open_rank_comm(env, o.backend, o.timeout_s, "bench");
  at::TensorOptions opts = at::TensorOptions().dtype(parse_dtype(o.dtype)).device(bc.device);
  dist::Communicator& comm = bc.comm();
  const int w = comm.size();
  const std::int64_t elem = at::elementSize(parse_dtype(o.dtype));

  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  nlohmann::ordered_json flat = nlohmann::ordered_json::object();
  for (int mb : o.sizes_mb) {
    // n elements in all (a multiple of w): the full buffer is mb MiB, as in peer_bench.py.
    const std::int64_t n = (static_cast<std::int64_t>(mb) * 1024 * 1024 / elem) / w * w;
    auto shard = at::randn({n / w}, opts);
    auto full = at::empty({n}, opts);
    auto buf = at::randn({n}, opts);
    struct Op {
      const char* name;
      std::function<dist::WorkPtr()> issue;
      double bus_factor;
    };
    const double ring = static_cast<double>(w - 1) / w;
    std::vector<Op> ops = {
        {"all_gather", [&] { return comm.all_gather(shard, full); }, ring},
        {"broadcast", [&] { return comm.broadcast(buf, 0); }, 1.0},
        {"reduce_scatter", [&] { return comm.reduce_scatter(full, shard); }, ring},
    };
    for (auto& op : ops) {
      for (int i = 0; i < o.warmup; ++i) op.issue()->wait();
      // Every rank starts timing together, then ops go back to back; the last one's completion
      // (ops on one communicator complete in order) ends the timing.
      auto flag = at::zeros({1}, at::kInt);
      bc.world->all_reduce(flag)->wait();
      auto t0 = std::chrono::steady_clock::now();
      std::vector<dist::WorkPtr> works;
      for (int i = 0; i < o.iters; ++i) works.push_back(op.issue());
      // Host time to issue one op: if it nears the op's time, the wrapper starves the GPU.
      const double issue = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.iters;
      for (auto& wk : works) wk->wait();
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.iters;
      // Two definitions of the op's time: the slowest rank's (what the collective costs the
      // group; the default) and rank 0's (how peer_bench.py and nccl-tests time it; for a
      // broadcast rank 0 is the root, which finishes first).
      auto t = at::tensor(std::vector<double>{dt, issue}, at::kDouble);
      auto rank0 = t.clone();
      bc.world->all_reduce(t, dist::ReduceOp::kMax)->wait();
      bc.world->broadcast(rank0, 0)->wait();
      dt = t[0].item<double>();
      const double issue_max = t[1].item<double>();
      const double dt0 = rank0[0].item<double>();
      const double bytes = static_cast<double>(n * elem);
      const double busbw = bytes / dt / 1e9 * op.bus_factor;
      const double busbw0 = bytes / dt0 / 1e9 * op.bus_factor;
      results.push_back({{"op", op.name}, {"size_mb", mb}, {"time_ms", dt * 1e3}, {"rank0_time_ms", dt0 * 1e3},
                         {"issue_us", issue_max * 1e6}, {"busbw_GBps", busbw}, {"rank0_busbw_GBps", busbw0}});
      flat[fmt::format("{}_{}MB_busbw_GBps", op.name, mb)] = std::round(busbw * 10) / 10;
      flat[fmt::format("{}_{}MB_rank0_busbw_GBps", op.name, mb)] = std::round(busbw0 * 10) / 10;
    }
  }
  if (env.rank() == 0) {
    nlohmann::ordered_json out = {{"bench", "collectives"}, {"backend", comm.backend()}, {"world", w},
                          {"dtype", o.dtype},       {"iters", o.iters},        {"warmup", o.warmup},
                          {"results", results}};
    out.update(flat);
    emit_json(out.dump(), o.out);
  }
  return 0;
}

}  // namespace

c10::ScalarType parse_dtype(const std::string& d) {
  if (d == "bf16") return at::kBFloat16;
  if (d == "fp32") return at::kFloat;
  if (d == "fp16") return at::kHalf;
  throw ConfigError(fmt::format("--dtype '{}': use bf16, fp16 or fp32", d));
}

void emit_json(const std::string& text, const std::string& out) {
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
  if (out.empty()) return;
  std::ofstream f(out);
  if (!(f << text << "\n")) throw IoError(fmt::format("--out {}: cannot write the results", out));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

RankComm open_rank_comm(dist::MpiEnv& env, const std::string& backend_opt, double timeout_s, const std::string& name) {
  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  std::string backend = backend_opt;
  if (backend == "auto") backend = dist::MpiEnv::have_nccl() && gpus > 0 ? "nccl" : "mpi";
  if (backend != "nccl" && backend != "mpi") throw ConfigError("--backend: use auto, nccl or mpi");
  RankComm bc;
  bc.world = env.world(timeout_s);
  if (backend == "nccl") {
    if (gpus == 0) {
      throw ConfigError(fmt::format("--backend nccl: no CUDA device is visible on rank {} ({}); use --backend mpi "
                                    "or run the GPU build on a GPU node", env.rank(), env.hostname()));
    }
    const int local = env.node_map(0, false, timeout_s).local_position(env.rank()).index % gpus;
    bc.nccl = dist::MpiEnv::nccl(*bc.world, local, name, timeout_s);
    bc.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local));
  }
  return bc;
}

void add_logprob_match(CLI::App* cmd, std::string& value) {
  cmd->add_option("--logprob-match", value,
                  "off: the default kernels; bitwise: algo.logprob_match = bitwise's batch-invariant kernels")
      ->check(CLI::IsMember({"off", "bitwise"}));
}

void apply_logprob_match(const std::string& value) {
  model::set_numerics(value == "bitwise" ? model::Numerics::kBatchInvariant : model::Numerics::kDefault);
}

void add_expert_kernels(CLI::App* cmd, std::string& value) {
  cmd->add_option("--experts", value,
                  "A mixture of experts' kernels: auto (grouped GEMMs on the GPU), grouped, or loop (one matmul per "
                  "expert, the routes grouped on the host)")
      ->check(CLI::IsMember({"auto", "grouped", "loop"}));
}

void apply_expert_kernels(const std::string& value) {
  model::set_expert_kernels(value == "grouped" ? model::ExpertKernels::kGrouped
                            : value == "loop"  ? model::ExpertKernels::kLoop
                                               : model::ExpertKernels::kAuto);
}

void add_bench_command(CLI::App& app, Runner& run, int& argc, char**& argv) {
  auto* bench = app.add_subcommand("bench", "Benchmarks; each prints JSON");
  bench->require_subcommand(1);
  auto* coll = bench->add_subcommand(
      "collectives", "Bus bandwidth of all_gather, reduce_scatter, broadcast (run under mpirun, one rank per GPU)");
  auto o = std::make_shared<BenchOptions>();
  coll->add_option("--sizes-mb", o->sizes_mb, "Buffer sizes in MiB")->delimiter(',')->check(CLI::Range(1, 65536));
  coll->add_option("--warmup", o->warmup, "Warm-up ops per measurement")->check(CLI::Range(0, 1000));
  coll->add_option("--iters", o->iters, "Timed ops per measurement")->check(CLI::Range(1, 100000));
  coll->add_option("--backend", o->backend, "auto (NCCL when GPUs are visible), nccl or mpi");
  coll->add_option("--dtype", o->dtype, "bf16, fp16 or fp32");
  coll->add_option("--timeout", o->timeout_s, "Deadline of each op, seconds")->check(CLI::Range(0.001, 1e7));
  coll->add_option("--out", o->out, "Also write the JSON here");
  coll->callback([&run, o, &argc, &argv] {
    run = [o, &argc, &argv] { return run_collectives(*o, &argc, &argv); };
  });
  add_bench_forward(bench, run);
  add_bench_generate(bench, run, argc, argv);
  add_bench_train(bench, run, argc, argv);
  add_bench_sync(bench, run, argc, argv);
  add_bench_push(bench, run, argc, argv);
  add_bench_controller(bench, run);
  add_bench_tokenize(bench, run);
  add_bench_adamw(bench, run, argc, argv);
}

}  // namespace tiller::cli
