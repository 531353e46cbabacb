// Delta weight sync pushed over the engines' gRPC services (sync/weight_push.h): the actor ranks
// train with AdamW and push each version to engines that take no part in any sync communicator,
// over real sockets. After every sync each engine rank holds the actor's weights bit for bit (its
// TP slices); the deltas are smaller than the weights; a damaged chunk is refused by the engine
// and pushed again in full; a push the engine did not begin is refused with the reason.
#include <atomic>
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "engine_checks.h"
#include "mpi_env_for_tests.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/engine/server.h"
#include "tiller/model/weights.h"
#include "tiller/sync/weight_push.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::test {
namespace {

dist::Communicator& comm() { return *mpi_test_env().comm; }
dist::Communicator& world() { return *mpi_test_env().world; }
at::Device device() { return mpi_test_env().device.device(); }

struct PushLayout {
  int actors = 1;
  int tp = 1;  // engines: (world - actors) / tp
};
std::vector<PushLayout> push_layouts(int p) {
  if (p == 2) return {{1, 1}};
  if (p == 3) return {{1, 2}};
  if (p == 4) return {{2, 2}, {2, 1}};
  return {};
}

// Actor ranks first, then engines of `tp` ranks whose leaders serve on loopback; every actor rank
// holds a client of every engine.
struct PushRig {
  PushLayout layout;
  model::ModelConfig cfg = model::preset("tiny-qwen2");
  int me = 0;
  std::unique_ptr<dist::Communicator> actor_comm, tp, control;
  std::unique_ptr<zero::ShardedModel> actor;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<sync::PushReceiver> receiver;
  std::unique_ptr<engine::EngineServer> server;
  std::vector<std::unique_ptr<engine::EngineClient>> clients;
  std::vector<sync::PushTarget> targets;

  explicit PushRig(PushLayout l) : layout(l), me(comm().rank()) {
    const bool is_actor = me < l.actors;
    const int engine_index = is_actor ? -1 : (me - l.actors) / l.tp;
    actor_comm = comm().split(is_actor ? 0 : -1, me, "actor");
    tp = comm().split(engine_index, me, "engine.tp");
    const bool leader = !is_actor && (me - l.actors) % l.tp == 0;
    control = world().split(is_actor || leader ? 0 : -1, me, "test.control");
    if (is_actor) {
      zero::ShardedModelOptions o;
      o.compute_dtype = device().is_cuda() ? at::kBFloat16 : at::kFloat;
      o.device = device();
      actor = std::make_unique<zero::ShardedModel>(cfg, *actor_comm, o);
      actor->load(model::init_weights(cfg, model::Head::kLm, 1, at::kFloat), "seed 1");
    } else {
      // bf16 engines with other weights (seed 9): the first push must replace every byte.
      model::NamedTensors w = model::init_weights(cfg, model::Head::kLm, 9, at::kFloat);
      for (auto& [n, t] : w) t = t.to(device(), at::kBFloat16);
      const model::ModelWeights full = model::bind_weights(cfg, w, model::Head::kLm, "seed 9");
      engine::EngineOptions o;
      o.device = device().str();
      o.block_size = 8;
      o.num_blocks = 64;
      engine = std::make_unique<engine::Engine>(cfg, engine::slice_for_tp(cfg, full, tp->rank(), tp->size()), o,
                                                l.tp > 1 ? tp.get() : nullptr);
      receiver = std::make_unique<sync::PushReceiver>(*engine, l.tp > 1 ? tp.get() : nullptr, 60);
      engine->set_weight_sink(receiver.get());
      if (leader) {
        engine::ServerOptions so;
        so.address = "127.0.0.1:0";
        so.heartbeat_seconds = 0.2;
        so.max_wait_seconds = 5;
        server = std::make_unique<engine::EngineServer>(*engine, so);
      }
    }
    at::Tensor ports = at::zeros({comm().size()}, at::kLong);
    if (server) ports[me] = server->port();
    if (!is_follower()) control->all_reduce(ports)->wait();
    if (is_actor)
      for (int e = 0; e < engines(); ++e) {
        engine::ClientOptions co;
        co.address = "127.0.0.1:" + std::to_string(ports[l.actors + e * l.tp].item<int64_t>());
        co.timeout_seconds = 60;
        clients.push_back(std::make_unique<engine::EngineClient>(co));
        targets.push_back({"engine " + std::to_string(e), clients.back().get()});
      }
  }
  bool is_actor() const { return actor != nullptr; }
  bool is_leader() const { return server != nullptr; }
  bool is_follower() const { return engine && !server; }
  int engines() const { return (comm().size() - layout.actors) / layout.tp; }
  // Actors and leaders (followers are in Engine::follow()).
  void barrier() {
    at::Tensor t = at::zeros({1}, at::kLong);
    control->all_reduce(t)->wait();
  }
};

// One AdamW step of the actor on its share of some text, at `lr`.
void train_step(PushRig& r, int step, double lr) {
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t i = 0; i < 3; ++i) {
    std::vector<int64_t> s;
    for (int64_t t = 0; t < 12; ++t) s.push_back((r.me * 101 + step * 7 + i * 17 + t * 29) % 480 + 3);
    seqs.push_back(s);
  }
  const auto batch = model::PackedBatch::pack(seqs, device());
  r.actor->token_logprobs(batch, batch.tokens.roll(-1)).mean().neg().backward();
  EXPECT_FALSE(r.actor->step(lr).skipped);
}

// The actor's weights in bf16, gathered on the actor ranks and broadcast over `control` to the
// engine leaders, flattened in name order; every actor and leader returns them by name.
model::NamedTensors actor_weights(PushRig& r) {
  const model::NamedTensors shapes = model::init_weights(r.cfg, model::Head::kLm, 1, at::kFloat);
  int64_t total = 0;
  for (const auto& [n, t] : shapes) total += t.numel();
  at::Tensor flat = at::zeros({total}, at::kFloat);
  if (r.is_actor()) {
    const model::NamedTensors g = r.actor->gather_parameters();
    std::vector<at::Tensor> parts;
    for (const auto& [n, t] : shapes) parts.push_back(g.at(n).to(at::kBFloat16).to(at::kFloat).cpu().flatten());
    flat = at::cat(parts);
  }
  r.control->broadcast(flat, 0)->wait();
  model::NamedTensors out;
  int64_t at = 0;
  for (const auto& [n, t] : shapes) {
    out[n] = flat.narrow(0, at, t.numel()).view(t.sizes()).to(at::kBFloat16);
    at += t.numel();
  }
  return out;
}

void expect_engine_holds(PushRig& r, const model::NamedTensors& want_full, const std::string& what) {
  expect_engine_slices(r.cfg, *r.engine, want_full, r.me, what);
}

// Versions 1..syncs: the actor steps (from version 2), rank 0 begins the update on every engine,
// every actor rank pushes, rank 0 ends it; `check` runs on actors and leaders after each.
void run_syncs(PushRig& r, const sync::BucketPlan& plan, sync::PushOptions opts, int syncs,
               const std::function<void(int version, const sync::PushStats&)>& after_push,
               const std::function<void(int version)>& check,
               const std::function<void(int version)>& between = nullptr) {
  if (r.is_follower()) {
    r.engine->follow();
    return;
  }
  std::unique_ptr<sync::WeightPusher> pusher;
  if (r.is_actor()) pusher = std::make_unique<sync::WeightPusher>(*r.actor, plan, opts);
  if (r.me == 0)
    for (auto& c : r.clients) EXPECT_EQ(c->install_sync_plan(plan.to_json()), plan.id);
  for (int v = 1; v <= syncs; ++v) {
    if (r.is_actor() && v > 1) train_step(r, v, v <= syncs / 2 ? 1e-3 : 1e-6);
    if (r.me == 0)
      for (auto& c : r.clients) c->begin_weight_update(static_cast<uint64_t>(v), false, plan.id);
    r.barrier();
    if (r.is_actor()) {
      const sync::PushStats st = pusher->push(static_cast<uint64_t>(v), r.targets);
      for (const auto& f : st.failed) EXPECT_EQ(f, "") << "version " << v;
      after_push(v, st);
    }
    r.barrier();
    if (r.me == 0)
      for (auto& c : r.clients) EXPECT_EQ(c->end_weight_update(static_cast<uint64_t>(v), 60), static_cast<uint64_t>(v));
    r.barrier();
    check(v);
    if (between) between(v);
  }
  r.barrier();
  if (r.is_leader()) {
    r.server->shutdown();
    r.engine->shutdown();
  }
}

TEST(PushSync, TenDeltaSyncsLeaveEveryEngineWithTheActorsBytes) {
  for (const PushLayout l : push_layouts(comm().size())) {
    PushRig r(l);
    // Buckets of ~40 KB in chunks of 64 KiB and more: several buckets per actor rank, one chunk each.
    const sync::BucketPlan plan = sync::make_bucket_plan(r.cfg, l.actors, l.tp, "bf16", 20000);
    sync::PushOptions opts;
    opts.chunk_bytes = 64 << 10;
    opts.threads = 2;
    std::map<int, sync::PushStats> stats;
    run_syncs(
        r, plan, opts, 10, [&](int v, const sync::PushStats& st) { stats[v] = st; },
        [&](int v) {
          const model::NamedTensors want = actor_weights(r);
          if (r.is_leader()) expect_engine_holds(r, want, "after version " + std::to_string(v));
        });
    if (r.is_follower()) {  // its slices, once its leader has shut down
      continue;
    }
    if (!r.is_actor()) continue;
    // The first push is full; the next ones carry what changed: at lr 1e-3 most elements, at 1e-6
    // a few, in far fewer bytes than the bucket.
    EXPECT_EQ(stats[1].full_chunks, stats[1].chunks);
    for (int v = 2; v <= 10; ++v) {
      EXPECT_EQ(stats[v].full_chunks, 0) << "version " << v;
      EXPECT_EQ(stats[v].resent_chunks, 0) << "version " << v;
      EXPECT_LT(stats[v].sent_bytes, stats[v].raw_bytes * r.engines()) << "version " << v;
    }
    EXPECT_LT(stats[10].sent_bytes * 5, stats[10].raw_bytes * r.engines()) << "lr 1e-6 should change few weights";
    EXPECT_GT(stats[10].sparse_chunks, 0);
  }
}

TEST(PushSync, AnEngineThatComesLateTakesEveryChunkInFullAndHoldsTheActorsBytes) {
  for (const PushLayout l : push_layouts(comm().size())) {
    if (l.tp != 1) continue;  // the leader swaps its receiver: no followers to swap with it
    PushRig r(l);
    const sync::BucketPlan plan = sync::make_bucket_plan(r.cfg, l.actors, l.tp, "bf16", 20000);
    sync::PushOptions opts;
    opts.chunk_bytes = 64 << 10;
    std::map<int, sync::PushStats> stats;
    std::unique_ptr<sync::PushReceiver> fresh;
    run_syncs(
        r, plan, opts, 7, [&](int v, const sync::PushStats& st) { stats[v] = st; },
        [&](int v) {
          const model::NamedTensors want = actor_weights(r);
          if (r.is_leader()) expect_engine_holds(r, want, "after version " + std::to_string(v));
        },
        [&](int v) {
          if (v != 5) return;
          // After version 5 every engine starts over as one that joins would: a new receiver with no
          // copy of any bucket, and the plan installed again.
          if (r.is_leader()) {
            fresh = std::make_unique<sync::PushReceiver>(*r.engine, nullptr, 60);
            r.engine->set_weight_sink(fresh.get());
          }
          r.barrier();
          if (r.me == 0)
            for (auto& c : r.clients) c->install_sync_plan(plan.to_json());
          r.barrier();
        });
    if (!r.is_actor()) continue;
    // Version 6: every delta is refused (no base on the engine) and pushed again in full; version 7
    // is deltas again.
    EXPECT_EQ(stats[6].resent_chunks, stats[6].chunks * r.engines());
    EXPECT_EQ(stats[7].resent_chunks, 0);
    EXPECT_EQ(stats[7].full_chunks, 0);
  }
}

TEST(PushSync, ADamagedChunkIsRefusedAndPushedAgainInFull) {
  const auto ls = push_layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  PushRig r(ls.front());
  const sync::BucketPlan plan = sync::make_bucket_plan(r.cfg, r.layout.actors, r.layout.tp, "bf16", 20000);
  sync::PushOptions opts;
  opts.chunk_bytes = 64 << 10;
  std::atomic<int> damaged{0};
  // In version 2 (a delta), the first chunk to engine 0 loses a byte of its result: the engine's
  // hash check must catch it.
  opts.on_chunk = [&](size_t e, engine::WeightChunk& c) {
    if (c.version == 2 && e == 0 && c.form != 0 && damaged.fetch_add(1) == 0) c.hash ^= 1;
  };
  int64_t resent = 0;
  run_syncs(
      r, plan, opts, 3, [&](int v, const sync::PushStats& st) { if (v == 2) resent = st.resent_chunks; },
      [&](int v) {
        const model::NamedTensors want = actor_weights(r);
        if (r.is_leader()) expect_engine_holds(r, want, "after version " + std::to_string(v));
      });
  if (r.me == 0) EXPECT_EQ(resent, 1);
}

TEST(PushSync, AChunkOfNoBegunUpdateIsRefusedWithTheReason) {
  const auto ls = push_layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  PushRig r(ls.front());
  const sync::BucketPlan plan = sync::make_bucket_plan(r.cfg, r.layout.actors, r.layout.tp, "bf16", 20000);
  if (r.is_follower()) {
    r.engine->follow();
    return;
  }
  if (r.me == 0)
    for (auto& c : r.clients) c->install_sync_plan(plan.to_json());
  r.barrier();
  if (r.is_actor()) {
    sync::PushOptions opts;
    opts.chunk_bytes = 64 << 10;
    opts.timeout_s = 30;
    sync::WeightPusher pusher(*r.actor, plan, opts);
    const sync::PushStats st = pusher.push(1, r.targets);  // nobody called BeginWeightUpdate
    ASSERT_EQ(st.failed.size(), static_cast<size_t>(r.engines()));
    for (const auto& f : st.failed) EXPECT_NE(f.find("no pushed sync to that version is in progress"), std::string::npos) << f;
  }
  r.barrier();
  if (r.is_leader()) {
    EXPECT_EQ(r.engine->weight_version(), 0u);  // nothing changed
    r.server->shutdown();
    r.engine->shutdown();
  }
}

}  // namespace
}  // namespace tiller::test
