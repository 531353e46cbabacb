// Routing replay (algo.routing_replay): the engine records the experts that routed every token it
// computed, and a forward given those routes (model::BlockContext::replay_routes) takes them. The
// sharded trainer's side (slices under SP, recomputed blocks) is tests/mpi/zero_test.cpp's
// RoutingReplayShardedEqualsUnshardedQwen3Moe; the whole loop is e2e.train.routing_replay.
#include "engine_fixture.h"

#include <torch/csrc/autograd/autograd.h>

#include "tiller/model/numerics.h"

namespace tiller::engine {
namespace {

// The hidden states of a packed forward, and each layer's experts (recorded_routes).
struct Routed {
  at::Tensor hidden;
  std::vector<at::Tensor> routes;  // per layer: int64 [T, k] for the sparse ones
};
Routed forward_routed(const model::ModelConfig& cfg, const model::ModelWeights& w, const model::PackedBatch& batch) {
  const model::Rope rope(cfg);
  model::BlockContext ctx = model::make_block_context(cfg, rope, batch, w.embed.scalar_type());
  Routed r;
  r.routes.resize(static_cast<size_t>(cfg.num_layers));
  ctx.recorded_routes = &r.routes;
  at::Tensor x = model::embed(w.embed, batch.tokens);
  for (int64_t l = 0; l < cfg.num_layers; ++l) x = model::block_forward(cfg, l, w.layers[l], x, ctx);
  r.hidden = model::final_norm(cfg, w.final_norm, x);
  return r;
}

// Recorded routes as BlockContext::replay_routes takes them: int16 [T, sparse layers, k].
at::Tensor replayable(const model::ModelConfig& cfg, const std::vector<at::Tensor>& per_layer) {
  std::vector<at::Tensor> sparse;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (cfg.sparse_layer(l)) sparse.push_back(per_layer[static_cast<size_t>(l)]);
  return at::stack(sparse, 1).to(at::kShort).contiguous();
}

TEST(RoutingReplay, ReplayedRoutesRouteTheForwardAndTrainTheRouter) {
  TinyModel m = tiny("tiny-qwen3-moe", 3);
  const auto seqs = prompts(3, 9, m.cfg.vocab_size, 12);
  model::PackedBatch batch = model::PackedBatch::pack(seqs, at::kCPU);
  c10::AutoGradMode no_grad(false);
  const Routed own = forward_routed(m.cfg, m.weights, batch);
  // Its own routes replayed: the same forward, bit for bit.
  batch.routes = replayable(m.cfg, own.routes);
  const Routed again = forward_routed(m.cfg, m.weights, batch);
  EXPECT_TRUE(at::equal(again.hidden, own.hidden));
  // Other experts (each shifted by one), the first sequence's rows left to the router: those rows
  // keep their own experts, the others take the replayed ones, and the output changes.
  at::Tensor other = (batch.routes.to(at::kLong) + 1).remainder(m.cfg.num_experts).to(at::kShort);
  other.narrow(0, 0, static_cast<int64_t>(seqs[0].size())).fill_(-1);
  batch.routes = other.contiguous();
  const Routed moved = forward_routed(m.cfg, m.weights, batch);
  const at::Tensor want = at::where(other.select(2, 0).unsqueeze(2) < 0, replayable(m.cfg, own.routes), other);
  EXPECT_TRUE(at::equal(replayable(m.cfg, moved.routes), want));
  EXPECT_FALSE(at::allclose(moved.hidden, own.hidden));
  const int64_t n0 = static_cast<int64_t>(seqs[0].size());
  // The first sequence is causally alone in the packing: its rows are its own forward's (up to
  // rounding: its tokens now share each expert's matmul with other rows).
  EXPECT_TRUE(at::allclose(moved.hidden.narrow(0, 0, n0), own.hidden.narrow(0, 0, n0), 1e-4, 1e-5));
  // The router of a sparse layer gets a gradient through its probabilities at the replayed experts.
  c10::AutoGradMode grad(true);
  model::ModelWeights w = m.weights;
  int64_t first_sparse = 0;
  while (!m.cfg.sparse_layer(first_sparse)) ++first_sparse;
  at::Tensor& router = w.layers[static_cast<size_t>(first_sparse)].router;
  router = router.detach().clone().requires_grad_(true);
  forward_routed(m.cfg, w, batch).hidden.pow(2).sum().backward();
  ASSERT_TRUE(router.grad().defined());
  EXPECT_GT(router.grad().abs().max().item<double>(), 0);
}

// Expert-load metrics (moe/<role>/sparse_layer_<i>/load_max...): each sparse layer's tokens per
// expert are its routes counted, over the rows asked for (a sequence-parallel slice's padding left out).
TEST(RoutingReplay, ExpertLoadCountsEachSparseLayersRoutedRows) {
  TinyModel m = tiny("tiny-qwen2-moe", 4);  // layer 0 dense: sparse layers are counted in their own order
  const auto seqs = prompts(3, 2, m.cfg.vocab_size, 10);
  const model::PackedBatch batch = model::PackedBatch::pack(seqs, at::kCPU);
  c10::AutoGradMode no_grad(false);
  const Routed own = forward_routed(m.cfg, m.weights, batch);
  const at::Tensor routes = replayable(m.cfg, own.routes).to(at::kLong);  // [T, sparse layers, k]
  for (int64_t rows : {int64_t{-1}, int64_t{5}}) {
    const model::Rope rope(m.cfg);
    model::BlockContext ctx = model::make_block_context(m.cfg, rope, batch, m.weights.embed.scalar_type());
    at::Tensor load;
    ctx.expert_load = &load;
    ctx.routed_rows = rows;
    at::Tensor x = model::embed(m.weights.embed, batch.tokens);
    for (int64_t l = 0; l < m.cfg.num_layers; ++l) x = model::block_forward(m.cfg, l, m.weights.layers[l], x, ctx);
    const int64_t n = rows < 0 ? batch.num_tokens() : rows, layers = model::sparse_layers(m.cfg);
    ASSERT_TRUE(load.defined());
    ASSERT_EQ(load.size(0), layers);
    ASSERT_EQ(load.size(1), m.cfg.num_experts);
    for (int64_t s = 0; s < layers; ++s) {
      const at::Tensor want = at::bincount(routes.narrow(0, 0, n).select(1, s).reshape({-1}), {}, m.cfg.num_experts);
      EXPECT_TRUE(at::equal(load[s].to(at::kLong), want)) << "sparse layer " << s << ", rows " << rows;
    }
    EXPECT_EQ(load.sum().item<double>(), static_cast<double>(n * layers * m.cfg.experts_per_token));
  }
}

TEST(RoutingReplay, RoutesOutOfRangeAreRefused) {
  TinyModel m = tiny("tiny-qwen3-moe", 3);
  model::PackedBatch batch = model::PackedBatch::pack({{1, 2, 3}}, at::kCPU);
  c10::AutoGradMode no_grad(false);
  batch.routes = at::full({3, model::sparse_layers(m.cfg), m.cfg.experts_per_token}, m.cfg.num_experts, at::kShort);
  try {
    forward_routed(m.cfg, m.weights, batch);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("expert " + std::to_string(m.cfg.num_experts)), std::string::npos) << e.what();
  }
  batch.routes = at::full({2, model::sparse_layers(m.cfg), m.cfg.experts_per_token}, 0, at::kShort);
  EXPECT_THROW(forward_routed(m.cfg, m.weights, batch), std::exception);
}

// The engine's routes of every token it computed equal the trainer's own routing of the same
// tokens in one packed forward (batch-invariant kernels: the same router probabilities), through
// chunked prefill, n > 1 samples forked from one prefill, preemption and recompute, and
// asynchronous scheduling.
TEST(RoutingReplay, TheEngineRecordsTheExpertsOfEveryTokenItComputed) {
  model::ScopedNumerics exact(model::Numerics::kBatchInvariant);
  TinyModel m = tiny("tiny-qwen2-moe", 1);
  for (auto& [name, t] : m.named) t = t.to(at::kBFloat16);
  m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, "tiny-qwen2-moe");
  const auto ps = prompts(10, 5, m.cfg.vocab_size, 40);
  EngineOptions o = small_options(20);
  o.limits.max_num_seqs = 6;
  o.record_routes = true;
  Engine e(m.cfg, m.weights, o);
  for (size_t i = 0; i < ps.size(); ++i) {
    SamplingParams p;
    p.temperature = 0.9f;
    p.seed = 7 * i + 1;
    p.max_new_tokens = 3 + static_cast<int64_t>(i % 4) * 6;
    e.add({i, ps[i], p, 1 + static_cast<int64_t>(i % 3)});
  }
  const auto out = run_all(e);
  EXPECT_GT(e.stats().preemptions, 0);
  const int64_t width = model::sparse_layers(m.cfg) * m.cfg.experts_per_token;
  std::vector<std::vector<int64_t>> seqs;
  std::vector<const SampleOutput*> outs;
  for (const auto& [key, s] : out) {
    std::vector<int64_t> seq = ps[key.first];
    seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
    ASSERT_EQ(s.route_width, width);
    ASSERT_EQ(static_cast<int64_t>(s.routes.size()), (static_cast<int64_t>(seq.size()) - 1) * width);
    seqs.push_back(std::move(seq));
    outs.push_back(&s);
  }
  c10::AutoGradMode no_grad(false);
  const Routed t = forward_routed(m.cfg, m.weights, model::PackedBatch::pack(seqs, at::kCPU));
  const at::Tensor trainer = replayable(m.cfg, t.routes).view({-1, width});
  int64_t row = 0, compared = 0, differing = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(seqs[i].size()) - 1;
    const at::Tensor engine = at::from_blob(const_cast<int16_t*>(outs[i]->routes.data()), {n, width}, at::kShort);
    differing += (trainer.narrow(0, row, n) != engine).any(1).sum().item<int64_t>();
    compared += n;
    row += n + 1;
  }
  EXPECT_GT(compared, 200);
  EXPECT_EQ(differing, 0) << "of " << compared << " tokens";
}

TEST(RoutingReplay, ADenseEngineRefusesToRecordRoutes) {
  TinyModel m = tiny("tiny-qwen2", 1);
  EngineOptions o = small_options(20);
  o.record_routes = true;
  try {
    Engine e(m.cfg, m.weights, o);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("needs a mixture-of-experts model"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tiller::engine
