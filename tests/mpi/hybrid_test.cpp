// The hybrid engine (cluster.hybrid): every rank is an actor rank and hosts its engine's TP rank
// in the same process. The handoff (sync/hybrid_handoff.h) leaves the engine's weights bit for bit
// what the disaggregated sync leaves (the actor's weights in the wire dtype, sliced for the TP
// rank: the reference both syncs are checked against, WeightSync.EngineEqualsActorBitForBit for
// the other); an engine put to sleep at level 2 (weights and KV cache freed) and woken gives the
// same greedy tokens after the next handoff; a handoff into an engine that did not park, or whose
// weights still sleep, is refused on every rank with nothing written.
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>

#include "mpi_env_for_tests.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/model/storage_swap.h"
#include "tiller/model/weights.h"
#include "tiller/sync/hybrid_handoff.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::test {
namespace {

dist::Communicator& comm() { return *mpi_test_env().comm; }
at::Device device() { return mpi_test_env().device.device(); }
bool on_gpu() { return device().is_cuda(); }
at::ScalarType compute() { return on_gpu() ? at::kBFloat16 : at::kFloat; }
std::string wire_name() { return on_gpu() ? "bf16" : "fp32"; }
// Every rank here before any goes on (followers' threads have finished what the leader started).
void barrier() { comm().all_reduce(at::zeros({1}, mpi_test_env().device))->wait(); }
// The same over the host: no collective left pending on the GPU while a rank waits.
void host_barrier() { mpi_test_env().world->all_reduce(at::zeros({1}))->wait(); }

model::ModelConfig tiny() {
  model::ModelConfig cfg = model::preset("tiny-qwen2");
  cfg.initializer_range = 0.25;  // logits far apart: greedy tokens are stable
  return cfg;
}

model::NamedTensors initial(int seed) { return model::init_weights(tiny(), model::Head::kLm, seed, at::kFloat); }

// One rank: the actor's ZeRO-3 shard over every rank, and TP rank (rank % tp) of engine rank / tp,
// whose followers run follow() on a thread of their own. `host_control`: as tiller train builds a
// hybrid TP engine, its control messages over the host (MPI) and its kernels on a stream of its own.
struct HybridRig {
  model::ModelConfig cfg = tiny();
  int tp = 1;
  std::unique_ptr<dist::Communicator> tp_comm, sync_comm, control_comm;
  std::unique_ptr<zero::ShardedModel> actor;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<sync::LocalWeightSink> sink;
  std::unique_ptr<sync::HybridHandoff> handoff;
  sync::BucketPlan plan;
  std::thread follower;

  // `lora`: a LoRA actor (its adapters `actor_adapters`), whose engine starts with `engine_adapters`.
  HybridRig(int tp_size, int engine_seed, double timeout_s, const model::LoraSpec* lora = nullptr,
            const model::NamedTensors* actor_adapters = nullptr, const model::NamedTensors* engine_adapters = nullptr,
            bool host_control = false)
      : tp(tp_size) {
    const int me = comm().rank();
    tp_comm = comm().split(me / tp, me, "engine.tp");
    if (host_control && tp > 1) control_comm = mpi_test_env().world->split(me / tp, me, "engine.control");
    sync_comm = comm().split(0, me, "weight_sync");
    zero::ShardedModelOptions o;
    o.compute_dtype = compute();
    o.device = device();
    model::NamedTensors from = initial(1);
    if (lora) {
      o.trainable = true;
      o.lora = *lora;
      for (const auto& [n, t] : *actor_adapters) from[n] = t;
    }
    actor = std::make_unique<zero::ShardedModel>(cfg, comm(), o);
    actor->load(from, "seed 1");
    model::NamedTensors w = initial(engine_seed);
    for (auto& [n, t] : w) t = t.to(device(), compute());
    model::ModelWeights local =
        engine::slice_for_tp(cfg, model::bind_weights(cfg, w, model::Head::kLm, "engine"), tp_comm->rank(), tp);
    if (lora) engine::bind_lora_for_tp(cfg, *lora, *engine_adapters, local, tp_comm->rank(), tp, device().str(), "test");
    engine::EngineOptions eo;
    eo.device = device().str();
    eo.block_size = 8;
    eo.num_blocks = 96;
    eo.limits.max_batched_tokens = 64;
    eo.own_stream = control_comm != nullptr;
    engine = std::make_unique<engine::Engine>(cfg, std::move(local), eo, tp > 1 ? tp_comm.get() : nullptr,
                                              control_comm.get());
    sink = std::make_unique<sync::LocalWeightSink>(*engine, timeout_s);
    engine->set_weight_sink(sink.get());
    plan = lora ? sync::make_lora_bucket_plan(cfg, *lora, comm().size(), tp, 3000)
                : sync::make_bucket_plan(cfg, comm().size(), tp, wire_name(), 3000);
    handoff = std::make_unique<sync::HybridHandoff>(*actor, *sync_comm, plan, *sink, timeout_s);
    if (engine->is_leader()) {
      EXPECT_EQ(engine->install_sync_plan(plan.to_json()), plan.id);
    } else {
      follower = std::thread([this] { engine->follow(); });
    }
  }
  ~HybridRig() {
    if (engine->is_leader()) engine->shutdown();
    if (follower.joinable()) follower.join();
  }

  // Every rank: one handoff to `version` (the leader's engine receives on a thread, as its server
  // loop does); returns the leader's outcome, or a complete result on followers.
  engine::WeightSink::Result sync(uint64_t version, bool expect_refusal, sync::SyncStats* stats = nullptr) {
    engine::WeightSink::Result r;
    r.complete = true;
    std::thread receive;
    if (engine->is_leader()) receive = std::thread([&] { r = engine->receive_weights(version); });
    if (expect_refusal) {
      EXPECT_THROW(handoff->send(version), sync::SyncRefused);
    } else {
      sync::SyncStats st;
      EXPECT_NO_THROW(st = handoff->send(version));
      if (stats) *stats = st;
    }
    if (receive.joinable()) receive.join();
    return r;
  }
};

std::vector<std::vector<int64_t>> prompts() {
  std::vector<std::vector<int64_t>> out;
  for (int64_t i = 0; i < 4; ++i) {
    std::vector<int64_t> p;
    for (int64_t t = 0; t < 5 + 3 * i; ++t) p.push_back((i * 37 + t * 11) % 480 + 3);
    out.push_back(p);
  }
  return out;
}

// Leader: the greedy tokens of every prompt, [prompts, 8].
at::Tensor generate(engine::Engine& e) {
  const auto ps = prompts();
  for (size_t i = 0; i < ps.size(); ++i) {
    engine::Request r;
    r.id = i;
    r.prompt = ps[i];
    r.params.greedy = true;
    r.params.max_new_tokens = 8;
    e.add(r);
  }
  at::Tensor out = at::full({static_cast<int64_t>(ps.size()), 8}, -1, at::kLong);
  while (e.has_work())
    for (const auto& s : e.step())
      for (size_t j = 0; j < s.tokens.size() && j < 8; ++j) out[s.request_id][j] = s.tokens[j];
  return out;
}

// The engine rank holds the actor's weights (seed 1) in the wire dtype, sliced for its TP rank:
// what the disaggregated sync leaves there.
void expect_engine_holds_actor(const HybridRig& r, const std::string& what) {
  model::NamedTensors w;
  for (const auto& [n, t] : initial(1)) w[n] = t.to(compute());
  const auto want = model::named_weights(
      r.cfg, engine::slice_for_tp(r.cfg, model::bind_weights(r.cfg, w, model::Head::kLm, "actor"),
                                  r.engine->tp_rank(), r.engine->tp_size()),
      model::Head::kLm);
  const auto got = r.engine->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [n, t] : want)
    EXPECT_TRUE(at::equal(got.at(n).cpu(), t)) << what << ": " << n << " differs on rank " << comm().rank();
}

std::vector<int> tp_sizes() {
  std::vector<int> out{1};
  if (comm().size() % 2 == 0) out.push_back(2);
  return out;
}

TEST(HybridSync, HandoffEqualsTheDisaggregatedSyncBitForBit) {
  for (int tp : tp_sizes()) {
    SCOPED_TRACE(fmt::format("{} actor ranks, TP {}", comm().size(), tp));
    HybridRig r(tp, /*engine_seed=*/9, 60);
    const auto res = r.sync(1, false);
    EXPECT_TRUE(res.complete) << res.error;
    barrier();
    expect_engine_holds_actor(r, "after the handoff");
    if (r.engine->is_leader()) EXPECT_TRUE(r.engine->weights_broken().empty());
  }
}

// A TP engine beside its trainers, as tiller train runs it (control over the host, its own
// stream): the trainer thread synchronises the device while the follower waits for a message (a
// phase change releases the allocator's cache), and runs collectives of its own from another
// thread while the engine generates (scoring during the generate phase). On GPUs, with the
// followers waiting in an NCCL broadcast and the engine on the trainer's stream, tiller train
// stalled so. The greedy tokens equal those of the engine generating alone, and the handoff
// lands. (While one rank's engine generates, the others wait on the host, as trainers wait for
// the controller: a device collective left pending under the engine's first steps would meet
// the device-wide synchronisation of their one-time set-up, cuBLAS's and NCCL's.)
TEST(HybridSync, ATensorParallelEngineRunsBesideItsTrainersCollectives) {
  if (comm().size() % 2) GTEST_SKIP() << "needs an even number of ranks";
  HybridRig r(2, /*engine_seed=*/9, 60, nullptr, nullptr, nullptr, /*host_control=*/true);
  auto trainer = comm().split(0, comm().rank(), "trainer");
  auto synchronise = [] {
    model::release_cached_device_memory(device());
    if (on_gpu()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->synchronizeDevice(device().index());
  };
  synchronise();
  barrier();
  const auto res = r.sync(1, false);
  EXPECT_TRUE(res.complete) << res.error;
  synchronise();
  barrier();
  expect_engine_holds_actor(r, "after the handoff");
  at::Tensor alone, beside;
  if (r.engine->is_leader()) alone = generate(*r.engine);
  host_barrier();
  // Every rank's trainer: 40 all-reduces, each followed on its stream by work that needs it.
  std::thread train([&] {
    if (on_gpu()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device());
    at::Tensor x = at::ones({1 << 16}, mpi_test_env().device);
    for (int i = 0; i < 40; ++i) {
      trainer->all_reduce(x)->wait_on_stream();
      x = x / comm().size();
    }
    EXPECT_TRUE(at::equal(x.cpu(), at::ones({1 << 16}))) << "the trainer's all-reduces";
  });
  std::thread engine_loop;  // the leader's engine runs on a thread of its own, as the server's loop
  if (r.engine->is_leader())
    engine_loop = std::thread([&] {
      r.engine->use_device_on_this_thread();
      beside = generate(*r.engine);
    });
  train.join();
  if (engine_loop.joinable()) engine_loop.join();
  synchronise();
  barrier();
  if (r.engine->is_leader()) EXPECT_TRUE(at::equal(beside, alone)) << "greedy tokens beside the trainer";
}

TEST(HybridSync, SleepAndWakeGiveTheSameGreedyTokensAfterTheNextSync) {
  for (int tp : tp_sizes()) {
    SCOPED_TRACE(fmt::format("{} actor ranks, TP {}", comm().size(), tp));
    HybridRig r(tp, /*engine_seed=*/1, 60);  // the engine starts from the actor's weights
    at::Tensor before;
    int64_t kv_bytes = 0, asleep = 0;
    const int64_t weight_bytes = r.engine->memory().weight_bytes;
    EXPECT_GT(weight_bytes, 0);
    if (r.engine->is_leader()) {
      before = generate(*r.engine);
      kv_bytes = r.engine->memory().kv_cache_bytes;
      EXPECT_GT(kv_bytes, 0);
      const int64_t awake = model::device_memory(device()).allocated;
      r.engine->sleep(2);
      const engine::EngineMemory m = r.engine->memory();
      EXPECT_EQ(m.sleep_level, 2);
      EXPECT_EQ(m.weight_bytes, 0);
      EXPECT_EQ(m.kv_cache_bytes, 0);
      // On the GPU the allocator's count drops by the cache and the weights (the decode graphs' pool too).
      asleep = model::device_memory(device()).allocated;
      if (on_gpu()) EXPECT_LE(asleep, awake - kv_bytes - weight_bytes);
      EXPECT_THROW(generate(*r.engine), engine::InvalidRequest) << "a request while asleep";
      r.engine->wake(/*weights=*/true, /*cache=*/false);
      EXPECT_EQ(r.engine->memory().weight_bytes, weight_bytes);
      EXPECT_EQ(r.engine->sleep_level(), 1);
    }
    const auto res = r.sync(1, false);
    EXPECT_TRUE(res.complete) << res.error;
    barrier();
    expect_engine_holds_actor(r, "after sleep 2, wake and the handoff");
    if (r.engine->is_leader()) {
      r.engine->weights_updated(1);
      r.engine->wake(false, true);
      EXPECT_EQ(r.engine->sleep_level(), 0);
      EXPECT_EQ(r.engine->memory().kv_cache_bytes, kv_bytes) << "the cache comes back at its size";
      if (on_gpu()) EXPECT_GE(model::device_memory(device()).allocated, asleep + kv_bytes + weight_bytes);
      EXPECT_TRUE(at::equal(generate(*r.engine), before)) << "greedy tokens after sleep, wake and sync";
    }
  }
}

TEST(HybridSync, AHandoffIntoSleepingWeightsOrAnEngineThatDidNotParkIsRefused) {
  const int tp = tp_sizes().back();
  HybridRig r(tp, /*engine_seed=*/9, 2);
  // Nobody parked: every rank refuses after the deadline, nothing written.
  EXPECT_THROW(r.handoff->send(1), sync::SyncRefused);
  // Parked, but the weights sleep (level 2): refused before any byte moves.
  if (r.engine->is_leader()) r.engine->sleep(2);
  const auto res = r.sync(1, /*expect_refusal=*/true);
  if (r.engine->is_leader()) {
    EXPECT_FALSE(res.complete);
    EXPECT_FALSE(res.weights_changed);
    EXPECT_NE(res.error.find("asleep"), std::string::npos) << res.error;
  }
  barrier();
}

// A LoRA actor's handoff: the adapters alone while the engine keeps its base (sleep level 1 or
// awake), the base before them when the engine dropped its weights (level 2); the engine then
// holds the actor's base and adapters bit for bit, and a later handoff replaces the adapters
// (nothing accumulates).
TEST(HybridSync, LoraActorSendsItsAdaptersAndTheBaseOnlyAfterTheEngineDroppedIt) {
  const model::ModelConfig cfg = tiny();
  model::LoraSpec spec;
  spec.rank = 4;
  spec.alpha = 8;
  spec.targets = model::lora_targets("q_proj,v_proj,o_proj,down_proj", cfg, "test");
  const model::NamedTensors adapters = test_adapters(cfg, spec, 3);
  const model::NamedTensors engine_adapters = model::init_lora(cfg, spec, 5);  // other A, zero B
  int64_t adapter_bytes = 0;
  for (const auto& [n, t] : adapters) adapter_bytes += 4 * t.numel();
  // This rank's engine holds the actor's base (seed 1) and its adapters times `factor`.
  auto expect_engine = [&](const HybridRig& r, double factor, const std::string& what) {
    model::NamedTensors w, scaled;
    for (const auto& [n, t] : initial(1)) w[n] = t.to(compute());
    for (const auto& [n, t] : adapters) scaled[n] = t * factor;
    model::ModelWeights want = engine::slice_for_tp(r.cfg, model::bind_weights(r.cfg, w, model::Head::kLm, "actor"),
                                                    r.engine->tp_rank(), r.engine->tp_size());
    engine::bind_lora_for_tp(r.cfg, spec, scaled, want, r.engine->tp_rank(), r.engine->tp_size(), "cpu", what);
    model::NamedTensors all = model::named_weights(r.cfg, want, model::Head::kLm);
    for (const auto& [n, t] : model::named_lora(want)) all[n] = t;
    const auto got = r.engine->parameters();
    ASSERT_EQ(got.size(), all.size());
    for (const auto& [n, t] : all)
      EXPECT_TRUE(at::equal(got.at(n).cpu(), t.cpu())) << what << ": " << n << " differs on rank " << comm().rank();
  };
  for (int tp : tp_sizes()) {
    SCOPED_TRACE(fmt::format("{} actor ranks, TP {}", comm().size(), tp));
    HybridRig r(tp, /*engine_seed=*/1, 60, &spec, &adapters, &engine_adapters);
    EXPECT_TRUE(r.plan.adapters_only());
    sync::SyncStats st;
    auto res = r.sync(1, false, &st);
    EXPECT_TRUE(res.complete) << res.error;
    EXPECT_EQ(st.wire_bytes, adapter_bytes) << "an engine that kept its base gets the adapters alone";
    barrier();
    expect_engine(r, 1.0, "after the first handoff");
    barrier();  // a follower's engine sleeps next: every rank has read its weights first

    if (r.engine->is_leader()) {
      r.engine->weights_updated(1);
      r.engine->sleep(2);
      r.engine->wake(/*weights=*/true, /*cache=*/false);  // memory back, contents undefined
    }
    barrier();
    r.actor->lora_flat().mul_(-2.0);
    res = r.sync(2, false, &st);
    EXPECT_TRUE(res.complete) << res.error;
    EXPECT_EQ(st.wire_bytes, adapter_bytes + sync::make_bucket_plan(cfg, comm().size(), tp, wire_name(), 3000).wire_bytes())
        << "after sleep level 2 the base travels too";
    barrier();
    expect_engine(r, -2.0, "after sleep 2, wake and the handoff");
    barrier();  // a follower's engine sleeps next: every rank has read its weights first

    if (r.engine->is_leader()) {
      r.engine->weights_updated(2);
      r.engine->sleep(1);
      r.engine->wake(true, true);
    }
    barrier();
    r.actor->lora_flat().mul_(-0.5);
    res = r.sync(3, false, &st);
    EXPECT_TRUE(res.complete) << res.error;
    EXPECT_EQ(st.wire_bytes, adapter_bytes) << "sleep level 1 keeps the base";
    barrier();
    expect_engine(r, 1.0, "after sleep 1 and the handoff: the adapters replaced, not added");
  }
}

}  // namespace
}  // namespace tiller::test
