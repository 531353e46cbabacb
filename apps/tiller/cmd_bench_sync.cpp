// tiller bench sync: the weight sync of a preset shape from a ZeRO-3 actor to engines, under
// mpirun. Ranks [0, actors) hold the actor (sharded over them), the rest are engine ranks in TP
// groups of --engine-tp. For each bucket size, the plan is installed on the engines once, then
// --syncs syncs are timed after --warmup: seconds from the header to the closing handshake (every
// engine's slices in place), on the slowest actor rank. GB/s is the parameter bytes per second
// that every engine rank receives; scripts/gpu/bench_sync.sh sets it beside NCCL's broadcast bus
// bandwidth measured by ../shared/bench/peer_bench.py nccl in the same run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/communicator.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/model/weights.h"
#include "tiller/sync/weight_sync.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::cli {
namespace {

struct SyncBenchOptions {
  std::string model = "qwen2-1.5b";
  int actors = 2;
  int engine_tp = 1;
  std::vector<int64_t> bucket_mb{256};
  int syncs = 5;
  int warmup = 2;
  std::string backend = "auto";
  double timeout_s = 300;
  std::string out;
};

int run_sync_bench(const SyncBenchOptions& o, int* argc, char*** argv) {
  dist::MpiEnv env(argc, argv);
  log::init(env.rank(), "bench", log::Level::kWarn);
  RankComm bc = open_rank_comm(env, o.backend, o.timeout_s, "bench.sync");
  dist::Communicator& comm = bc.comm();
  const at::Device dev = bc.device;
  const int world = comm.size(), me = comm.rank();
  if (o.actors < 1 || world - o.actors < o.engine_tp || (world - o.actors) % o.engine_tp)
    throw ConfigError(fmt::format("bench sync: {} ranks cannot hold {} actor ranks and engines of TP {} (the ranks "
                                  "after the actor's must be a multiple of --engine-tp)",
                                  world, o.actors, o.engine_tp));
  const bool actor = me < o.actors;
  const int engine_index = actor ? -1 : (me - o.actors) / o.engine_tp;
  auto actor_comm = comm.split(actor ? 0 : -1, me, "actor");
  auto tp = comm.split(engine_index, me, fmt::format("engine{}.tp", engine_index));
  auto sync_comm = comm.split(0, me, "weight_sync");  // actor ranks first: they are the lowest

  const model::ModelConfig cfg = model::preset(o.model);
  const at::ScalarType dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  const std::string wire = dev.is_cuda() ? "bf16" : "fp32";
  const int engines = (world - o.actors) / o.engine_tp;

  std::unique_ptr<zero::ShardedModel> model;
  std::unique_ptr<engine::Engine> eng;
  std::unique_ptr<sync::WeightReceiver> receiver;
  if (actor) {
    zero::ShardedModelOptions mo;
    mo.compute_dtype = dtype;
    mo.device = dev;
    mo.trainable = false;  // the sync reads the compute shards; no optimizer state is needed
    model = std::make_unique<zero::ShardedModel>(cfg, *actor_comm, mo);
    model->load(model::init_weights(cfg, model::Head::kLm, 1, dtype, dev), o.model);
  } else {
    const model::ModelWeights full =
        model::bind_weights(cfg, model::init_weights(cfg, model::Head::kLm, 2, dtype, dev), model::Head::kLm, o.model);
    engine::EngineOptions eo;
    eo.device = dev.str();
    eo.kv_cache_gb = 0.25;
    eo.cuda_graphs = false;
    eng = std::make_unique<engine::Engine>(cfg, engine::slice_for_tp(cfg, full, tp->rank(), tp->size()), eo, tp.get());
    receiver = std::make_unique<sync::WeightReceiver>(*eng, *sync_comm, o.timeout_s);
    eng->set_weight_sink(receiver.get());
  }
  if (eng && !eng->is_leader()) {
    eng->follow();  // the leader installs the plans and runs the syncs; shutdown() ends this
    return 0;
  }

  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  uint64_t version = 0;
  for (int64_t mb : o.bucket_mb) {
    const sync::BucketPlan plan = sync::make_bucket_plan(cfg, o.actors, o.engine_tp, wire, mb << 20);
    if (eng) {
      eng->install_sync_plan(plan.to_json());
      for (int i = 0; i < o.warmup + o.syncs; ++i) {
        const auto r = eng->receive_weights(++version);
        if (!r.complete) throw CommError(r.error);
      }
      continue;
    }
    sync::WeightSender sender(*model, *sync_comm, plan, o.timeout_s);
    std::vector<double> secs;
    for (int i = 0; i < o.warmup + o.syncs; ++i) {
      auto flag = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(dev));
      actor_comm->all_reduce(flag)->wait();  // the actor ranks start together
      const sync::SyncStats st = sender.send(++version);
      if (i >= o.warmup) secs.push_back(st.seconds);
    }
    at::Tensor t = at::tensor({median(secs), *std::min_element(secs.begin(), secs.end())}, at::kDouble).to(dev);
    actor_comm->all_reduce(t, dist::ReduceOp::kMax)->wait();
    t = t.cpu();
    const double sec = t[0].item<double>(), best = t[1].item<double>();
    nlohmann::ordered_json r;
    r["bucket_mb"] = mb;
    r["buckets"] = plan.buckets.size();
    r["wire_MB"] = static_cast<double>(plan.wire_bytes()) / 1e6;
    r["seconds"] = sec;
    r["seconds_min"] = best;
    r["GBps"] = static_cast<double>(plan.parameter_bytes()) / sec / 1e9;
    rows.push_back(r);
  }
  if (eng) {
    eng->shutdown();
    return 0;
  }
  if (me == 0) {
    const sync::BucketPlan any = sync::make_bucket_plan(cfg, o.actors, o.engine_tp, wire, o.bucket_mb.front() << 20);
    nlohmann::ordered_json r;
    r["bench"] = "sync";
    r["model"] = o.model;
    r["backend"] = comm.backend();
    r["world"] = world;
    r["actors"] = o.actors;
    r["engines"] = engines;
    r["engine_tp"] = o.engine_tp;
    r["wire_dtype"] = wire;
    r["parameter_GB"] = static_cast<double>(any.parameter_bytes()) / 1e9;
    r["syncs_timed"] = o.syncs;
    r["results"] = rows;
    auto best = std::max_element(rows.begin(), rows.end(),
                                 [](const auto& a, const auto& b) { return a["GBps"] < b["GBps"]; });
    r["best"] = *best;
    emit_json(r.dump(), o.out);
  }
  return 0;
}

}  // namespace

void add_bench_sync(CLI::App* bench, Runner& run, int& argc, char**& argv) {
  auto* s = bench->add_subcommand(
      "sync", "Weight sync from a ZeRO-3 actor to engines (under mpirun: actor ranks first, then engine ranks)");
  auto o = std::make_shared<SyncBenchOptions>();
  s->add_option("--model", o->model, "Preset shape: qwen2-0.5b, qwen2-1.5b, qwen2-7b, tiny-*");
  s->add_option("--actors", o->actors, "Actor ranks (the first ones)")->check(CLI::Range(1, 4096));
  s->add_option("--engine-tp", o->engine_tp, "Ranks per engine")->check(CLI::Range(1, 64));
  s->add_option("--bucket-mb", o->bucket_mb, "Bucket limits to sweep, MiB (comma-separated)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  s->add_option("--syncs", o->syncs, "Timed syncs per bucket size")->check(CLI::Range(1, 10000));
  s->add_option("--warmup", o->warmup, "Untimed syncs first")->check(CLI::Range(0, 10000));
  s->add_option("--backend", o->backend, "auto (NCCL when GPUs are visible), nccl or mpi");
  s->add_option("--timeout", o->timeout_s, "Deadline of one sync, seconds")->check(CLI::Range(0.001, 1e7));
  s->add_option("--out", o->out, "Also write the JSON here");
  s->callback([&run, o, &argc, &argv] { run = [o, &argc, &argv] { return run_sync_bench(*o, &argc, &argv); }; });
}

}  // namespace tiller::cli
