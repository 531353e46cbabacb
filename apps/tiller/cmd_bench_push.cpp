// tiller bench push: delta weight sync (sync/weight_push.h) against full pushes, over gRPC to an
// engine on the same host, after real optimizer steps. One process: a trained actor of a preset
// shape (AdamW at --lr on random token batches), and an engine behind its gRPC service on
// loopback that takes pushed syncs. Each round trains one step, then syncs the new weights twice:
// as deltas against the engine's copy, then in full (the same weights: a full push is what a
// joining engine, or a transport without deltas, sends). Both are timed from Begin to End (every
// bucket in place), with the bytes on the wire, the forms chosen and the encoding's seconds.
#include <algorithm>
#include <chrono>

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
#include "tiller/engine/server.h"
#include "tiller/model/weights.h"
#include "tiller/sync/weight_push.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::cli {
namespace {

struct PushBenchOptions {
  std::string model = "qwen2-1.5b";
  int rounds = 5;
  double lr = 1e-6;
  int64_t bucket_mb = 256;
  int64_t chunk_mb = 8;
  int threads = 0;
  int seq = 512;
  double timeout_s = 600;
  std::string out;
};

int run_push_bench(const PushBenchOptions& o, int* argc, char*** argv) {
  dist::MpiEnv env(argc, argv);
  log::init(env.rank(), "bench", log::Level::kWarn);
  if (env.size() != 1) throw ConfigError("bench push runs in one process (the actor and the engine side by side)");
  RankComm rc = open_rank_comm(env, "mpi", o.timeout_s, "bench.push");
  const at::Device dev = at::detail::getCUDAHooks().getNumGPUs() > 0 ? at::Device("cuda:0") : at::Device(at::kCPU);
  const model::ModelConfig cfg = model::preset(o.model);
  const at::ScalarType dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  const std::string wire = dev.is_cuda() ? "bf16" : "fp32";

  zero::ShardedModelOptions mo;
  mo.compute_dtype = dtype;
  mo.device = dev;
  zero::ShardedModel actor(cfg, rc.comm(), mo);
  actor.load(model::init_weights(cfg, model::Head::kLm, 1, dtype, dev), o.model);

  engine::EngineOptions eo;
  eo.device = dev.str();
  eo.kv_cache_gb = 0.25;
  eo.cuda_graphs = false;
  engine::Engine eng(cfg,
                     model::bind_weights(cfg, model::init_weights(cfg, model::Head::kLm, 2, dtype, dev), model::Head::kLm,
                                         o.model),
                     eo);
  sync::PushReceiver receiver(eng, nullptr, o.timeout_s);
  eng.set_weight_sink(&receiver);
  engine::ServerOptions so;
  so.address = "127.0.0.1:0";
  engine::EngineServer server(eng, so);
  engine::ClientOptions co;
  co.address = fmt::format("127.0.0.1:{}", server.port());
  co.timeout_seconds = o.timeout_s;
  engine::EngineClient client(co);
  const std::vector<sync::PushTarget> targets{{"engine 0 (" + co.address + ")", &client}};

  const sync::BucketPlan plan = sync::make_bucket_plan(cfg, 1, 1, wire, o.bucket_mb << 20);
  client.install_sync_plan(plan.to_json());
  sync::PushOptions po;
  po.chunk_bytes = static_cast<uint64_t>(o.chunk_mb) << 20;
  po.threads = o.threads;
  po.timeout_s = o.timeout_s;
  sync::WeightPusher delta(actor, plan, po);
  po.delta = false;
  sync::WeightPusher full(actor, plan, po);

  uint64_t version = 0;
  auto sync_once = [&](sync::WeightPusher& pusher) {
    ++version;
    const auto t0 = std::chrono::steady_clock::now();
    client.begin_weight_update(version, false, plan.id);
    const sync::PushStats st = pusher.push(version, targets);
    if (!st.all_succeeded()) throw CommError(st.failed.front());
    client.end_weight_update(version, o.timeout_s);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    nlohmann::ordered_json j;
    j["seconds"] = secs;
    j["push_seconds"] = st.seconds;
    j["pack_seconds"] = st.pack_seconds;
    j["encode_seconds"] = st.encode_seconds;
    j["engine_seconds"] = receiver.last().seconds;
    j["wire_MB"] = static_cast<double>(st.sent_bytes) / 1e6;
    j["raw_MB"] = static_cast<double>(st.raw_bytes) / 1e6;
    j["changed_share"] = static_cast<double>(st.changed_elements) / static_cast<double>(plan.wire_bytes() / plan.element_size());
    j["chunks"] = {{"full", st.full_chunks}, {"xor", st.xor_chunks}, {"sparse", st.sparse_chunks}};
    j["buckets_placed"] = receiver.last().buckets_placed;
    return j;
  };

  at::manual_seed(7);
  nlohmann::ordered_json rounds = nlohmann::ordered_json::array();
  // The delta pusher's first push is full (it has no base yet): the engine's copy starts as the actor's.
  nlohmann::ordered_json first = sync_once(delta);
  for (int i = 0; i < o.rounds; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor ids = at::randint(cfg.vocab_size, {2, o.seq}, at::TensorOptions().dtype(at::kLong));
    std::vector<std::vector<int64_t>> seqs;
    for (int s = 0; s < 2; ++s) {
      const at::Tensor row = ids[s].contiguous();
      seqs.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + o.seq);
    }
    const auto batch = model::PackedBatch::pack(seqs, dev);
    actor.token_logprobs(batch, batch.tokens.roll(-1)).mean().neg().backward();
    actor.step(o.lr);
    const double train_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    nlohmann::ordered_json r;
    r["round"] = i + 1;
    r["train_seconds"] = train_s;
    r["delta"] = sync_once(delta);
    r["full"] = sync_once(full);
    r["delta_vs_full_bytes"] = r["full"]["wire_MB"].get<double>() / std::max(r["delta"]["wire_MB"].get<double>(), 1e-9);
    r["delta_vs_full_seconds"] = r["full"]["seconds"].get<double>() / r["delta"]["seconds"].get<double>();
    rounds.push_back(r);
  }
  server.shutdown();
  nlohmann::ordered_json out;
  out["bench"] = "push";
  out["model"] = o.model;
  out["device"] = dev.str();
  out["wire_dtype"] = wire;
  out["parameter_GB"] = static_cast<double>(plan.parameter_bytes()) / 1e9;
  out["buckets"] = plan.buckets.size();
  out["chunk_mb"] = o.chunk_mb;
  out["threads"] = o.threads;
  out["lr"] = o.lr;
  out["first_full"] = first;
  out["rounds"] = rounds;
  emit_json(out.dump(), o.out);
  return 0;
}

}  // namespace

void add_bench_push(CLI::App* bench, Runner& run, int& argc, char**& argv) {
  auto* s = bench->add_subcommand(
      "push", "Delta weight sync against full pushes over gRPC to an engine on this host, after real AdamW steps");
  auto o = std::make_shared<PushBenchOptions>();
  s->add_option("--model", o->model, "Preset shape: qwen2-0.5b, qwen2-1.5b, qwen2-7b, tiny-*");
  s->add_option("--rounds", o->rounds, "Training steps, each followed by a delta and a full sync")
      ->check(CLI::Range(1, 1000));
  s->add_option("--lr", o->lr, "AdamW learning rate of the steps")->check(CLI::Range(1e-12, 1.0));
  s->add_option("--bucket-mb", o->bucket_mb, "Bucket limit, MiB")->check(CLI::Range(int64_t{1}, int64_t{4096}));
  s->add_option("--chunk-mb", o->chunk_mb, "Chunk size, MiB (each chunk is encoded and checked on its own)")
      ->check(CLI::Range(int64_t{1}, int64_t{32}));
  s->add_option("--threads", o->threads, "Encoding threads (0: the hardware's, at most 16)")->check(CLI::Range(0, 256));
  s->add_option("--seq", o->seq, "Tokens per sequence of the training batch (2 sequences)")->check(CLI::Range(2, 1 << 16));
  s->add_option("--timeout", o->timeout_s, "Deadline of one sync, seconds")->check(CLI::Range(0.001, 1e7));
  s->add_option("--out", o->out, "Also write the JSON here");
  s->callback([&run, o, &argc, &argv] { run = [o, &argc, &argv] { return run_push_bench(*o, &argc, &argv); }; });
}

}  // namespace tiller::cli
