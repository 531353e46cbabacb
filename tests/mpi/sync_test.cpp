// The weight sync across processes: actor ranks first, then engine ranks (TP groups), on the
// backend under test (MPI on CPU, NCCL on GPUs). After a sync every engine parameter equals the
// actor's bit for bit; a sync after an optimizer step changes what the engine generates (to what
// the trained model generates); refused, timed-out and part-way-failed syncs are reported through
// the engine's gRPC control exchange, and the engine keeps serving its previous version or, once
// bytes were written, refuses requests.
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "engine_checks.h"
#include "mpi_env_for_tests.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/engine/server.h"
#include "tiller/model/lora.h"
#include "tiller/model/weights.h"
#include "tiller/sync/weight_sync.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::test {
namespace {

dist::Communicator& comm() { return *mpi_test_env().comm; }
dist::Communicator& world() { return *mpi_test_env().world; }
at::Device device() { return mpi_test_env().device.device(); }
bool on_gpu() { return device().is_cuda(); }

struct Layout {
  int actors = 1;
  int tp = 1;  // engines: (world - actors) / tp
};
std::vector<Layout> layouts(int p) {
  if (p == 2) return {{1, 1}};
  if (p == 3) return {{2, 1}, {1, 2}};
  if (p == 4) return {{2, 2}, {2, 1}};
  return {};
}

std::string wire_name(at::ScalarType t) { return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32"; }

model::ModelConfig tiny(const std::string& preset = "tiny-qwen2") {
  model::ModelConfig cfg = model::preset(preset);
  cfg.initializer_range = 0.25;  // logits far enough apart that greedy tokens are stable
  return cfg;
}

// The actor's initial weights (seed 1) and the engines' different ones (seed 9), on the host.
model::NamedTensors initial(int seed, const std::string& preset = "tiny-qwen2") {
  return model::init_weights(tiny(preset), model::Head::kLm, seed, at::kFloat);
}

// One rank's part: communicators, the actor (on actor ranks) or an engine with its receiver.
struct Rig {
  Layout layout;
  model::ModelConfig cfg;
  int me = 0;
  std::unique_ptr<dist::Communicator> actor_comm, tp, sync, control;
  std::unique_ptr<zero::ShardedModel> actor;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<sync::WeightReceiver> receiver;

  // `lora`: a LoRA actor (its adapters `adapters`, its base seed 1) and engines that loaded the
  // same base with zeroed adapters, as an adapter-only sync expects.
  Rig(Layout l, at::ScalarType engine_dtype, double timeout_s, const std::string& preset = "tiny-qwen2",
      const model::LoraSpec* lora = nullptr, const model::NamedTensors* adapters = nullptr)
      : layout(l), cfg(tiny(preset)), me(comm().rank()) {
    const bool is_actor = me < l.actors;
    const int engine_index = is_actor ? -1 : (me - l.actors) / l.tp;
    actor_comm = comm().split(is_actor ? 0 : -1, me, "actor");
    tp = comm().split(engine_index, me, "engine.tp");
    sync = comm().split(0, me, "weight_sync");
    // Actors and engine leaders (followers sit in Engine::follow()): the test's own coordination.
    const bool leader = !is_actor && (me - l.actors) % l.tp == 0;
    control = world().split(is_actor || leader ? 0 : -1, me, "test.control");
    if (is_actor) {
      zero::ShardedModelOptions o;
      o.compute_dtype = on_gpu() ? at::kBFloat16 : at::kFloat;
      o.device = device();
      if (lora) o.lora = *lora;
      actor = std::make_unique<zero::ShardedModel>(cfg, *actor_comm, o);
      model::NamedTensors w = initial(1, preset);
      if (adapters) w.insert(adapters->begin(), adapters->end());
      actor->load(w, "seed 1");
    } else {
      model::NamedTensors w = initial(lora ? 1 : 9, preset);
      for (auto& [n, t] : w) t = t.to(device(), engine_dtype);
      const model::ModelWeights full = model::bind_weights(cfg, w, model::Head::kLm, "seed 9");
      model::ModelWeights mine = engine::slice_for_tp(cfg, full, tp->rank(), tp->size());
      if (lora) {
        model::NamedTensors zeros;
        for (const model::ParamSpec& p : model::lora_parameter_specs(cfg, *lora)) zeros[p.name] = at::zeros(p.shape);
        engine::bind_lora_for_tp(cfg, *lora, zeros, mine, tp->rank(), tp->size(), device().str(), "zeroed adapters");
      }
      engine::EngineOptions o;
      o.device = device().str();
      o.block_size = 8;
      o.num_blocks = 96;
      o.limits.max_batched_tokens = 64;
      engine = std::make_unique<engine::Engine>(cfg, std::move(mine), o, tp.get());
      receiver = std::make_unique<sync::WeightReceiver>(*engine, *sync, timeout_s);
      engine->set_weight_sink(receiver.get());
    }
  }
  bool is_actor() const { return actor != nullptr; }
  bool is_leader() const { return engine && engine->is_leader(); }
  bool is_follower() const { return engine && !engine->is_leader(); }
  int engine_leader_world_rank(int e) const { return layout.actors + e * layout.tp; }
  int engines() const { return (comm().size() - layout.actors) / layout.tp; }
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

engine::Request greedy(uint64_t id, std::vector<int64_t> prompt) {
  engine::Request r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.params.greedy = true;
  r.params.max_new_tokens = 8;
  return r;
}

// Greedy tokens of every prompt, [prompts, 8], by request id.
at::Tensor generate(engine::Engine& e) {
  const auto ps = prompts();
  for (size_t i = 0; i < ps.size(); ++i) e.add(greedy(i, ps[i]));
  at::Tensor out = at::full({static_cast<int64_t>(ps.size()), 8}, -1, at::kLong);
  while (e.has_work())
    for (const auto& s : e.step())
      for (size_t j = 0; j < s.tokens.size() && j < 8; ++j) out[s.request_id][j] = s.tokens[j];
  return out;
}

at::Tensor generate(engine::EngineClient& c) {
  const auto ps = prompts();
  std::vector<engine::Request> reqs;
  for (size_t i = 0; i < ps.size(); ++i) reqs.push_back(greedy(i, ps[i]));
  at::Tensor out = at::full({static_cast<int64_t>(ps.size()), 8}, -1, at::kLong);
  for (const auto& s : c.generate(reqs, Deadline::after_seconds(60)))
    for (size_t j = 0; j < s.tokens.size() && j < 8; ++j) out[s.request_id][j] = s.tokens[j];
  return out;
}

// What an engine rank must hold: the actor's parameters in the wire dtype, sliced for its TP rank.
void expect_engine_holds(const Rig& r, const model::NamedTensors& actor_full, at::ScalarType wire,
                         const std::string& what) {
  model::NamedTensors w;
  for (const auto& [n, t] : actor_full) w[n] = t.to(wire);
  expect_engine_slices(r.cfg, *r.engine, w, r.me, what);
}

// One sync of `plan` at version 1 through every rank of the rig: the engines' leaders install the
// plan and receive, their followers follow, the actors send.
void sync_once(Rig& r, const sync::BucketPlan& plan) {
  if (r.is_follower()) {
    r.engine->follow();
  } else if (r.is_leader()) {
    EXPECT_EQ(r.engine->install_sync_plan(plan.to_json()), plan.id);
    const auto res = r.engine->receive_weights(1);
    EXPECT_TRUE(res.complete) << res.error;
    EXPECT_TRUE(r.engine->weights_broken().empty());
    r.engine->shutdown();
  } else if (r.is_actor()) {
    sync::WeightSender sender(*r.actor, *r.sync, plan, 60);
    EXPECT_EQ(sender.send(1).buckets, static_cast<int64_t>(plan.buckets.size()));
  }
}

TEST(WeightSync, EngineEqualsActorBitForBit) {
  const auto ls = layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  const at::ScalarType direct = on_gpu() ? at::kBFloat16 : at::kFloat;     // the actor's compute dtype
  const at::ScalarType converted = on_gpu() ? at::kFloat : at::kBFloat16;  // from the fp32 masters
  struct Case {
    int64_t bytes;
    at::ScalarType wire;
  };
  // Smaller than any parameter; between; larger than the whole model.
  for (const Case& c : {Case{96, direct}, Case{6000, converted}, Case{int64_t{1} << 40, direct}})
    for (const Layout& l : ls) {
      const std::string what = fmt::format("{} actor ranks, TP {}, buckets of {} B, {}", l.actors, l.tp, c.bytes,
                                           wire_name(c.wire));
      SCOPED_TRACE(what);
      Rig r(l, c.wire, 60);
      sync_once(r, sync::make_bucket_plan(r.cfg, l.actors, l.tp, wire_name(c.wire), c.bytes));
      if (r.engine) expect_engine_holds(r, initial(1), c.wire, what);
    }
}

// A mixture of experts reaches the engine bit for bit through the same bucket plan, at engine TP 1
// and 2 (each TP rank gets every expert's slice): qwen2_moe (the router, every expert, the shared
// expert and its gate, and a dense layer) and mixtral (experts named w1/w3/w2).
TEST(WeightSync, ExpertsReachTheEngineBitForBit) {
  const auto ls = layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  const at::ScalarType direct = on_gpu() ? at::kBFloat16 : at::kFloat;
  for (const char* preset : {"tiny-qwen2-moe", "tiny-mixtral"})
  for (const int64_t bytes : {int64_t{96}, int64_t{6000}})
    for (const Layout& l : ls) {
      const std::string what =
          fmt::format("{}, {} actor ranks, engine TP {}, buckets of {} B", preset, l.actors, l.tp, bytes);
      SCOPED_TRACE(what);
      Rig r(l, direct, 60, preset);
      sync_once(r, sync::make_bucket_plan(r.cfg, l.actors, l.tp, wire_name(direct), bytes));
      if (r.engine) expect_engine_holds(r, initial(1, preset), direct, what);
    }
}

// A LoRA actor syncs its adapters alone (make_lora_bucket_plan): every engine rank keeps the base
// it loaded and holds the actor's fp32 adapters bit for bit, its TP slice of each (B by rows for
// q/k/v/gate/up, A by columns for o/down); a second sync with other adapters replaces them, so
// nothing accumulates; and the wire carries the adapters only.
TEST(WeightSync, LoraActorSyncsItsAdaptersOnly) {
  const auto ls = layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  const at::ScalarType direct = on_gpu() ? at::kBFloat16 : at::kFloat;
  const model::ModelConfig cfg = tiny();
  model::LoraSpec spec;
  spec.rank = 4;
  spec.alpha = 8;
  spec.targets = model::lora_targets("all-linear", cfg, "test");
  const model::NamedTensors adapters = test_adapters(cfg, spec, 3);
  // What an engine rank must hold: the adapters scaled by `factor`, its slice of each.
  auto expect_adapters = [&](const Rig& r, double factor, const std::string& what) {
    model::NamedTensors scaled;
    for (const auto& [n, t] : adapters) scaled[n] = t * factor;
    model::ModelWeights w;
    w.layers.resize(static_cast<size_t>(cfg.num_layers));
    engine::bind_lora_for_tp(cfg, spec, scaled, w, r.engine->tp_rank(), r.engine->tp_size(), "cpu", what);
    const auto got = r.engine->parameters();
    int64_t checked = 0;
    for (const auto& [n, t] : model::named_lora(w)) {
      EXPECT_TRUE(at::equal(got.at(n).cpu(), t)) << what << ": " << n << " on world rank " << r.me;
      ++checked;
    }
    EXPECT_EQ(checked, static_cast<int64_t>(adapters.size()));
  };
  for (const int64_t bytes : {int64_t{96}, int64_t{1} << 40})
    for (const Layout& l : ls) {
      const std::string what = fmt::format("{} actor ranks, engine TP {}, buckets of {} B", l.actors, l.tp, bytes);
      SCOPED_TRACE(what);
      Rig r(l, direct, 60, "tiny-qwen2", &spec, &adapters);
      const sync::BucketPlan plan = sync::make_lora_bucket_plan(r.cfg, spec, l.actors, l.tp, bytes);
      EXPECT_TRUE(plan.adapters_only());
      EXPECT_EQ(plan.wire_bytes(), static_cast<int64_t>(4 * [&] {
                  int64_t n = 0;
                  for (const auto& [k, t] : adapters) n += t.numel();
                  return n;
                }()));
      if (r.is_follower()) {
        r.engine->follow();
      } else if (r.is_leader()) {
        EXPECT_EQ(r.engine->install_sync_plan(plan.to_json()), plan.id);
        for (uint64_t version : {1, 2}) {
          const auto res = r.engine->receive_weights(version);
          EXPECT_TRUE(res.complete) << res.error;
          if (version == 1) expect_adapters(r, 1.0, what + ", first sync");
        }
        expect_adapters(r, -2.0, what + ", second sync");
        r.engine->shutdown();
      } else if (r.is_actor()) {
        sync::WeightSender sender(*r.actor, *r.sync, plan, 60);
        sender.send(1);
        r.actor->lora_flat().mul_(-2.0);  // other adapters: the engines must hold these, not a sum
        sender.send(2);
        // A LoRA actor refuses a full-weight plan (the engines would get a base and no adapters).
        EXPECT_THROW(sync::WeightSender(*r.actor, *r.sync, sync::make_bucket_plan(r.cfg, l.actors, l.tp, "fp32", bytes),
                                        60),
                     ConfigError);
      }
      if (r.engine && !r.is_follower()) {
        // The base is the one the engine loaded: its seed-1 weights, untouched by either sync.
        model::NamedTensors w = initial(1);
        for (auto& [n, t] : w) t = t.to(direct);
        const auto want = model::named_weights(
            r.cfg, engine::slice_for_tp(r.cfg, model::bind_weights(r.cfg, w, model::Head::kLm, "base"),
                                        r.engine->tp_rank(), r.engine->tp_size()),
            model::Head::kLm);
        const auto got = r.engine->parameters();
        for (const auto& [n, t] : want) EXPECT_TRUE(at::equal(got.at(n).cpu(), t)) << what << ": base " << n;
      }
    }
}

TEST(WeightSync, SyncAfterAnOptimizerStepChangesWhatTheEngineGenerates) {
  const auto ls = layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  const Layout l = ls.front();
  // fp32 engines, so that TP and the reference engine agree token for token (see engine_tp_test).
  Rig r(l, at::kFloat, 60);
  const sync::BucketPlan plan = sync::make_bucket_plan(r.cfg, l.actors, l.tp, "fp32", 4096);
  at::Tensor before = at::zeros({4, 8}, at::kLong), after = at::zeros({4, 8}, at::kLong);
  if (r.is_follower()) {
    r.engine->follow();
  } else if (r.is_leader()) {
    r.engine->install_sync_plan(plan.to_json());
    ASSERT_TRUE(r.engine->receive_weights(1).complete);
    before = generate(*r.engine);
    ASSERT_TRUE(r.engine->receive_weights(2).complete);
    after = generate(*r.engine);
    r.engine->shutdown();
  } else {
    sync::WeightSender sender(*r.actor, *r.sync, plan, 60);
    sender.send(1);
    // One optimizer step on this rank's share of some text.
    std::vector<std::vector<int64_t>> seqs;
    for (int64_t i = 0; i < 3; ++i) {
      std::vector<int64_t> s;
      for (int64_t t = 0; t < 12; ++t) s.push_back((r.me * 101 + i * 17 + t * 29) % 480 + 3);
      seqs.push_back(s);
    }
    const auto batch = model::PackedBatch::pack(seqs, device());
    r.actor->token_logprobs(batch, batch.tokens.roll(-1)).mean().neg().backward();
    const auto step = r.actor->step(0.05);
    EXPECT_FALSE(step.skipped);
    sender.send(2);
  }
  // The engine leader's tokens reach actor rank 0, which generates with the trained weights.
  model::NamedTensors trained;
  if (r.is_actor()) trained = r.actor->gather_parameters();
  if (r.is_follower()) return;
  const int leader = r.engine_leader_world_rank(0);
  const int leader_at = l.actors;  // its rank in `control` (the actor ranks come first)
  (void)leader;
  r.control->broadcast(before, leader_at)->wait();
  r.control->broadcast(after, leader_at)->wait();
  if (r.me != 0) return;
  EXPECT_FALSE(at::equal(before, after)) << "the optimizer step did not change the engine's greedy tokens";
  model::NamedTensors w;
  for (const auto& [n, t] : trained) w[n] = t.to(device(), at::kFloat);
  engine::EngineOptions o;
  o.device = device().str();
  o.block_size = 8;
  o.num_blocks = 96;
  engine::Engine reference(r.cfg, model::bind_weights(r.cfg, w, model::Head::kLm, "trained"), o);
  EXPECT_TRUE(at::equal(after, generate(reference))) << "engine after the sync:\n" << after << "\nthe trained actor:\n"
                                                     << generate(reference);
}

// Every engine leader serves; the ports reach every rank of `control`.
struct Served {
  std::unique_ptr<engine::EngineServer> server;
  std::vector<std::unique_ptr<engine::EngineClient>> clients;  // actor rank 0 only
};
Served serve(Rig& r) {
  Served s;
  if (r.is_leader()) {
    engine::ServerOptions so;
    so.address = "127.0.0.1:0";
    so.heartbeat_seconds = 0.2;
    s.server = std::make_unique<engine::EngineServer>(*r.engine, so);
  }
  at::Tensor ports = at::zeros({comm().size()}, at::kLong);
  if (s.server) ports[r.me] = s.server->port();
  r.control->all_reduce(ports)->wait();
  if (r.me == 0)
    for (int e = 0; e < r.engines(); ++e) {
      engine::ClientOptions co;
      co.address = "127.0.0.1:" + std::to_string(ports[r.engine_leader_world_rank(e)].item<int64_t>());
      s.clients.push_back(std::make_unique<engine::EngineClient>(co));
    }
  return s;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(WeightSync, RefusedAndTimedOutSyncsKeepThePreviousVersion) {
  const auto ls = layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  const Layout l = ls.back();
  const double timeout = on_gpu() ? 5.0 : 2.0;
  Rig r(l, at::kFloat, timeout);
  const sync::BucketPlan plan = sync::make_bucket_plan(r.cfg, l.actors, l.tp, "fp32", 2048);
  if (r.is_follower()) {
    r.engine->follow();
    return;
  }
  Served s = serve(r);
  auto barrier = [&] { r.actor_comm->all_reduce(at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device())))->wait(); };
  std::unique_ptr<sync::WeightSender> sender;
  if (r.is_actor()) sender = std::make_unique<sync::WeightSender>(*r.actor, *r.sync, plan, timeout);
  if (r.me == 0) {
    // A plan for bf16 weights does not fit these fp32 engines; this one does.
    const std::string wrong = sync::make_bucket_plan(r.cfg, l.actors, l.tp, "bf16", 2048).to_json();
    for (auto& c : s.clients) {
      const std::string m = message_of([&] { c->install_sync_plan(wrong); });
      EXPECT_NE(m.find("does not fit"), std::string::npos) << m;
      EXPECT_EQ(c->install_sync_plan(plan.to_json()), plan.id);
      EXPECT_NE(message_of([&] { c->begin_weight_update(1, false, plan.id + 1); }).find("not installed"),
                std::string::npos);
    }
    for (auto& c : s.clients) EXPECT_EQ(c->begin_weight_update(1, false, plan.id), 0u);
  }
  if (r.is_actor()) {
    barrier();
    sender->send(1);
  }
  at::Tensor v1;
  if (r.me == 0) {
    for (auto& c : s.clients) EXPECT_EQ(c->end_weight_update(1, 60), 1u);
    v1 = generate(*s.clients.front());
    for (auto& c : s.clients) EXPECT_TRUE(at::equal(generate(*c), v1));
    // Refused: the actor sends version 5 while the engines expect 2.
    for (auto& c : s.clients) c->begin_weight_update(2, false, plan.id);
  }
  if (r.is_actor()) {
    barrier();
    const std::string m = message_of([&] { sender->send(5); });
    EXPECT_NE(m.find("refused"), std::string::npos) << m;
    EXPECT_NE(m.find("engine sync rank"), std::string::npos) << m;
    EXPECT_NE(m.find("expect another version"), std::string::npos) << m;
  }
  if (r.me == 0) {
    for (auto& c : s.clients) {
      const std::string m = message_of([&] { c->end_weight_update(2, 60); });
      EXPECT_NE(m.find("refused"), std::string::npos) << m;
      EXPECT_NE(m.find("keeps serving version 1"), std::string::npos) << m;
      EXPECT_EQ(c->health().weight_version, 1u);
      EXPECT_EQ(c->health().status, "serving");
      EXPECT_TRUE(at::equal(generate(*c), v1));
    }
    // Timed out: the engines begin, the actor never sends.
    for (auto& c : s.clients) c->begin_weight_update(3, false, plan.id);
    for (auto& c : s.clients) {
      const std::string m = message_of([&] { c->end_weight_update(3, 60); });
      EXPECT_NE(m.find("failed before any weight changed"), std::string::npos) << m;
      EXPECT_NE(m.find("keeps serving version 1"), std::string::npos) << m;
      EXPECT_EQ(c->health().weight_version, 1u);
      EXPECT_TRUE(at::equal(generate(*c), v1)) << "the engine must serve version 1 unchanged";
    }
  }
  r.control->all_reduce(at::zeros({1}, at::kInt))->wait();  // the controller is done
  if (s.server) s.server->shutdown();
}

// The actor's side of the sync communicator, failing every broadcast after the first `keep`
// buckets (the header is let through): the engines see the sync stop part way.
class StopsAfter final : public dist::Communicator {
 public:
  StopsAfter(dist::Communicator& inner, int keep) : inner_(inner), left_(keep + 1) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const std::string& name() const override { return inner_.name(); }
  const char* backend() const override { return inner_.backend(); }
  void set_timeout(double s) override { inner_.set_timeout(s); }
  double timeout() const override { return inner_.timeout(); }
  dist::WorkPtr all_gather(const at::Tensor& i, const at::Tensor& o) override { return inner_.all_gather(i, o); }
  dist::WorkPtr reduce_scatter(const at::Tensor& i, const at::Tensor& o, dist::ReduceOp op) override {
    return inner_.reduce_scatter(i, o, op);
  }
  dist::WorkPtr all_to_all(const at::Tensor& i, const at::Tensor& o) override { return inner_.all_to_all(i, o); }
  dist::WorkPtr all_reduce(const at::Tensor& t, dist::ReduceOp op) override { return inner_.all_reduce(t, op); }
  dist::WorkPtr broadcast(const at::Tensor& t, int root) override {
    if (left_-- > 0) return inner_.broadcast(t, root);
    return std::make_shared<Failed>();
  }
  dist::WorkPtr send(const at::Tensor& t, int peer) override { return inner_.send(t, peer); }
  dist::WorkPtr recv(const at::Tensor& t, int peer) override { return inner_.recv(t, peer); }
  std::unique_ptr<dist::Communicator> split(int, int, const std::string&) override { return nullptr; }
  bool aborted() const override { return inner_.aborted(); }

 private:
  struct Failed final : dist::Work {
    void wait(Deadline) override { wait(); }
    void wait() override { throw CommError("injected: this actor rank stopped sending"); }
    bool is_completed() override { wait(); return true; }
    void wait_on_stream() override { wait(); }
  };
  dist::Communicator& inner_;
  int left_;
};

TEST(WeightSync, FailurePartWayIsReportedAndTheEngineRefusesRequests) {
  const auto ls = layouts(comm().size());
  if (ls.empty()) GTEST_SKIP() << "needs 2 to 4 ranks";
  const Layout l = ls.front();
  const double timeout = on_gpu() ? 5.0 : 2.0;
  Rig r(l, at::kFloat, timeout);
  const sync::BucketPlan plan = sync::make_bucket_plan(r.cfg, l.actors, l.tp, "fp32", 2048);
  ASSERT_GT(plan.buckets.size(), static_cast<size_t>(4 * l.actors));
  if (r.is_follower()) {
    r.engine->follow();
    return;
  }
  Served s = serve(r);
  if (r.me == 0)
    for (auto& c : s.clients) {
      c->install_sync_plan(plan.to_json());
      c->begin_weight_update(1, false, plan.id);
    }
  if (r.is_actor()) {
    r.actor_comm->all_reduce(at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device())))->wait();
    StopsAfter faulty(*r.sync, 2 * l.actors);
    sync::WeightSender sender(*r.actor, faulty, plan, timeout);
    EXPECT_THROW(sender.send(1), CommError);
  }
  if (r.me == 0)
    for (auto& c : s.clients) {
      const std::string m = message_of([&] { c->end_weight_update(1, 60); });
      EXPECT_NE(m.find("part way"), std::string::npos) << m;
      EXPECT_NE(m.find("refused until a sync completes"), std::string::npos) << m;
      EXPECT_EQ(c->health().status, "weights_incomplete");
      EXPECT_EQ(c->health().weight_version, 0u);
      const std::string g = message_of([&] { generate(*c); });
      EXPECT_NE(g.find("weights are incomplete"), std::string::npos) << g;
    }
  r.control->all_reduce(at::zeros({1}, at::kInt))->wait();
  if (s.server) s.server->shutdown();
}

}  // namespace
}  // namespace tiller::test
