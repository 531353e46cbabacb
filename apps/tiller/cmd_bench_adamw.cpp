// tiller bench adamw: the host AdamW of optimizer offload (zero/host_adamw.h) on a rank's shard of
// a preset shape, beside the host's memory bandwidth measured with the same threads, so a run
// shows how far the update is from what the memory allows and which thread count to give
// train.optimizer_threads. Run it under mpirun with the ranks a node will run (they share the
// host's memory bandwidth, as in training): every rank holds 1/world of the parameters (or
// --params-m millions), its gradients and compute shards on its GPU (the CPU without one), and
// the ranks start each step together.
//
// For each --threads value: --warmup untimed steps, then the median of --steps timed steps on the
// slowest rank: seconds, the update's share and the copy waits, parameters/s per rank and over
// all ranks, and the update's host memory traffic in GB/s (30 bytes a parameter: the gradient
// read, master and both moments read and written, the rounded bf16 written). "traffic_GBps" is the
// same 30 bytes an element moved without the arithmetic (p, m, v += g; a 2-byte store) over arrays
// of 1 GiB (or the rank's state), with the same threads on every rank at once: the host's ceiling
// for the update.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <thread>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "model/torch_compat.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/model/model_config.h"
#include "tiller/zero/host_adamw.h"

namespace tiller::cli {
namespace {

struct AdamwBenchOptions {
  std::string model = "qwen2-7b";
  double params_m = 0;  // per rank; 0: the model's parameters over the ranks
  std::vector<int> threads;  // empty: default_optimizer_threads()
  int64_t chunk_m = 4;       // millions of elements per streamed chunk (the trainer's default is 4Mi)
  int steps = 3;
  int warmup = 1;
  std::string backend = "auto";
  double timeout_s = 600;
  std::string out;
};

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The update's memory traffic without its arithmetic: p, m and v read and written, g read, a
// 2-byte value written, per element (the 30 bytes the update moves), over n elements split in
// `threads` contiguous parts, all threads at once; seconds.
// Vectorised as the update is (host_adamw.cpp is built with -O3 and AVX-512/AVX2 clones), so
// instructions do not bound it before memory does.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
__attribute__((optimize("O3"), target_clones("avx512f", "avx2", "default")))
#endif
void traffic_part(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                  uint16_t* __restrict out, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
    out[i] = static_cast<uint16_t>(i);
  }
}

double traffic_pass(float* p, float* m, float* v, const float* g, uint16_t* out, int64_t n, int threads) {
  const auto t0 = Clock::now();
  std::vector<std::thread> team;
  const int64_t per = (n + threads - 1) / threads;
  for (int k = 0; k < threads; ++k) {
    team.emplace_back([=] {
      const int64_t lo = std::min(n, per * k), hi = std::min(n, lo + per);
      traffic_part(p, m, v, g, out, lo, hi);
    });
  }
  for (auto& t : team) t.join();
  return since(t0);
}

int run_adamw_bench(const AdamwBenchOptions& o, int* argc, char*** argv) {
  dist::MpiEnv env(argc, argv);
  log::init(env.rank(), "bench", log::Level::kWarn);
  RankComm bc = open_rank_comm(env, o.backend, o.timeout_s, "bench.adamw");
  const int world = bc.world->size();
  const at::Device dev = bc.device;
  const model::ModelConfig cfg = model::preset(o.model);
  const int64_t total = o.params_m > 0 ? static_cast<int64_t>(o.params_m * 1e6) * world : model::num_parameters(cfg);
  const int64_t n = (total / world + 31) / 32 * 32;  // this rank's elements
  const std::vector<int> threads = o.threads.empty() ? std::vector<int>{zero::default_optimizer_threads()} : o.threads;
  const int64_t chunk = o.chunk_m * (int64_t{1} << 20);
  auto sync_all = [&] {
    auto flag = at::zeros({1}, at::kInt);
    bc.world->all_reduce(flag)->wait();
  };
  auto slowest = [&](std::vector<double> v) {
    at::Tensor t = at::tensor(v, at::kDouble);
    bc.world->all_reduce(t, dist::ReduceOp::kMax)->wait();
    return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  };

  // The rank's gradient and bf16 compute shard where training keeps them, in unit-sized pieces
  // (a 7B block is ~233M parameters; 28 pieces of a 7B rank's half are ~136M each).
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(cfg.num_layers, n / chunk));
  std::vector<at::Tensor> grads, compute;
  const auto on_dev = at::TensorOptions().device(dev);
  for (int64_t p = 0, b = 0; p < pieces; ++p) {
    const int64_t e = p + 1 == pieces ? n : (b + n / pieces) / 32 * 32;
    grads.push_back(at::randn({e - b}, on_dev.dtype(at::kFloat)).mul_(1e-3));
    compute.push_back(at::empty({e - b}, on_dev.dtype(dev.is_cuda() ? at::kBFloat16 : at::kFloat)));
    b = e;
  }

  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (int th : threads) {
    TILLER_CHECK(th >= 1 && th <= 1024, "--threads {}: give 1 to 1024", th);
    zero::AdamWConfig ac;
    zero::HostAdamW adam(ac, dev, th, chunk);
    for (size_t i = 0; i < grads.size(); ++i) {
      const size_t s = adam.add(grads[i].numel(), at::ones({grads[i].numel()}, at::kFloat));
      adam.master(s).fill_(0.01);
    }
    std::vector<double> secs, upd, wait;
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      compat::synchronize(dev);
      sync_all();
      const auto t0 = Clock::now();
      adam.step(1e-5, 1.0, grads, compute);
      compat::synchronize(dev);
      const double dt = since(t0);
      if (s < o.warmup) continue;
      secs.push_back(dt);
      upd.push_back(adam.last_timing().update_s);
      wait.push_back(adam.last_timing().copy_wait_s);
    }
    // The host's ceiling with the same threads, every rank at once, over arrays far larger than
    // the caches (1 GiB each at most).
    std::vector<double> ceiling;
    const int64_t sn = std::min<int64_t>(n, int64_t{1} << 28);
    {
      std::vector<at::Tensor> f;
      for (int k = 0; k < 4; ++k) f.push_back(at::zeros({sn}, at::kFloat));
      at::Tensor out16 = at::zeros({sn}, at::kShort);
      for (int s = 0; s < 1 + o.steps; ++s) {
        sync_all();
        const double dt = traffic_pass(f[0].data_ptr<float>(), f[1].data_ptr<float>(), f[2].data_ptr<float>(),
                                       f[3].data_ptr<float>(), reinterpret_cast<uint16_t*>(out16.data_ptr<int16_t>()),
                                       sn, th);
        if (s > 0) ceiling.push_back(dt);
      }
    }
    const std::vector<double> r = slowest({median(secs), median(upd), median(wait), median(ceiling)});
    nlohmann::ordered_json row;
    row["threads"] = th;
    row["step_s"] = r[0];
    row["update_s"] = r[1];
    row["copy_wait_s"] = r[2];
    row["params_per_s_per_rank"] = static_cast<double>(n) / r[0];
    row["params_per_s_all_ranks"] = static_cast<double>(n) * world / r[0];
    row["update_GBps_all_ranks"] = 30.0 * static_cast<double>(n) * world / r[1] / 1e9;
    row["traffic_GBps_all_ranks"] = 30.0 * static_cast<double>(sn) * world / r[3] / 1e9;
    row["update_over_traffic"] = row["update_GBps_all_ranks"].get<double>() / row["traffic_GBps_all_ranks"].get<double>();
    rows.push_back(row);
  }
  if (env.rank() == 0) {
    nlohmann::ordered_json j;
    j["bench"] = "adamw";
    j["model"] = o.model;
    j["device"] = dev.str();
    j["ranks"] = world;
    j["params_per_rank"] = n;
    j["chunk_elements"] = chunk;
    j["host_cores"] = std::thread::hardware_concurrency();
    j["results"] = rows;
    emit_json(j.dump(), o.out);
  }
  return 0;
}

}  // namespace

void add_bench_adamw(CLI::App* bench, Runner& run, int& argc, char**& argv) {
  auto* cmd = bench->add_subcommand(
      "adamw", "Host AdamW (optimizer offload) on a rank's shard, beside the host's memory bandwidth (under mpirun)");
  auto o = std::make_shared<AdamwBenchOptions>();
  cmd->add_option("--model", o->model, "Preset shape whose parameters the ranks share");
  cmd->add_option("--params-m", o->params_m, "Millions of parameters per rank instead of the model's share")
      ->check(CLI::Range(0.001, 1e5));
  cmd->add_option("--threads", o->threads, "Update threads per rank, a list (default: cores / ranks on the node)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--chunk-m", o->chunk_m, "Mi elements per streamed chunk")->check(CLI::Range(1, 1024));
  cmd->add_option("--steps", o->steps, "Timed steps")->check(CLI::Range(1, 1000));
  cmd->add_option("--warmup", o->warmup, "Untimed steps first")->check(CLI::Range(0, 100));
  cmd->add_option("--backend", o->backend, "auto (NCCL when GPUs are visible), nccl or mpi");
  cmd->add_option("--timeout", o->timeout_s, "Deadline of each collective, seconds")->check(CLI::Range(1.0, 1e6));
  cmd->add_option("--out", o->out, "Also write the JSON here");
  cmd->callback([&run, o, &argc, &argv] {
    run = [o, &argc, &argv] { return run_adamw_bench(*o, &argc, &argv); };
  });
}

}  // namespace tiller::cli
