// Routing replay (algo.routing_replay): the engine records the experts that routed every token it
// computed, and a forward given those routes (model::BlockContext::replay_routes) takes them. The
// sharded trainer's side (slices under SP, recomputed blocks) is tests/mpi/zero_test.cpp's
// RoutingReplayShardedEqualsUnshardedQwen3Moe; the whole loop is e2e.train.routing_replay.
// Also the two ways of running the experts (model::ExpertKernels): the grouped GEMMs equal the
// per-expert loop on the CPU (fp32) and on CUDA (bf16, the engine's decode captured in CUDA graphs).
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

// One sparse-model forward with every MoE option of BlockContext on (recorded routes, replayed
// routes for all but the first sequence, expert load and router losses over the first rows), then
// a backward through the hidden states and the router losses: what the two expert kernels must
// agree on.
struct MoeRun {
  at::Tensor hidden, load, aux, z;
  std::vector<at::Tensor> routes;
  std::map<std::string, at::Tensor> grads;
};
MoeRun moe_run(const model::ModelConfig& cfg, const model::NamedTensors& named, const std::string& preset,
               const model::PackedBatch& batch, model::ExpertKernels kernels) {
  model::ScopedExpertKernels use(kernels);
  c10::AutoGradMode grad(true);
  model::NamedTensors params;
  for (const auto& [name, t] : named) params[name] = t.detach().clone().requires_grad_(true);
  const model::ModelWeights w = model::bind_weights(cfg, params, model::Head::kLm, preset);
  const model::Rope rope(cfg);
  model::BlockContext ctx = model::make_block_context(cfg, rope, batch, w.embed.scalar_type());
  MoeRun r;
  r.routes.resize(static_cast<size_t>(cfg.num_layers));
  ctx.recorded_routes = &r.routes;
  ctx.replay_routes = batch.routes;
  ctx.expert_load = &r.load;
  model::RouterLoss rl;
  rl.aux_coef = 0.1;
  rl.z_coef = 0.01;
  ctx.router_loss = &rl;
  ctx.routed_rows = batch.num_tokens() - 3;
  at::Tensor x = model::embed(w.embed, batch.tokens);
  at::Tensor losses = at::zeros({}, x.options());
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    x = model::block_forward(cfg, l, w.layers[l], x, ctx);
    if (cfg.sparse_layer(l)) losses = losses + rl.layer;
  }
  r.hidden = model::final_norm(cfg, w.final_norm, x);
  // A fixed random direction of the outputs (their squares would not do: RMSNorm fixes their mean).
  at::Generator gen = at::detail::createCPUGenerator(17);
  const at::Tensor probe = at::randn(r.hidden.sizes(), gen, at::kFloat).to(r.hidden.device());
  ((r.hidden.to(at::kFloat) * probe).sum() + losses).backward();
  r.aux = rl.aux_sum;
  r.z = rl.z_sum;
  for (const auto& [name, t] : params) r.grads[name] = t.grad().defined() ? t.grad() : at::zeros_like(t);
  r.hidden = r.hidden.detach();
  return r;
}

// The grouped GEMMs equal the loop: outputs, routes (own and replayed), expert load, router losses
// and every parameter's gradient (the experts', the router's, the shared expert's), in fp32 on the
// CPU, where ATen's grouped GEMM multiplies each expert's rows as one matmul.
TEST(GroupedExperts, EqualTheLoopInForwardRoutesLoadLossesAndGradients) {
  for (const std::string preset : {"tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"}) {
    TinyModel m = tiny(preset, 5);
    const auto seqs = prompts(4, 3, m.cfg.vocab_size, 14);
    model::PackedBatch batch = model::PackedBatch::pack(seqs, at::kCPU);
    {  // replayed routes (the router's own, each expert shifted by one) for all but the first sequence
      c10::AutoGradMode no_grad(false);
      model::ScopedExpertKernels loop(model::ExpertKernels::kLoop);
      at::Tensor own = replayable(m.cfg, forward_routed(m.cfg, m.weights, batch).routes);
      own = (own.to(at::kLong) + 1).remainder(m.cfg.num_experts).to(at::kShort);
      own.narrow(0, 0, static_cast<int64_t>(seqs[0].size())).fill_(-1);
      batch.routes = own.contiguous();
    }
    ASSERT_FALSE(model::grouped_experts(m.cfg, at::kFloat, at::kCPU)) << "the CPU runs the loop by default";
    {
      model::ScopedExpertKernels grouped(model::ExpertKernels::kGrouped);
      ASSERT_TRUE(model::grouped_experts(m.cfg, at::kFloat, at::kCPU));
    }
    const MoeRun loop = moe_run(m.cfg, m.named, preset, batch, model::ExpertKernels::kLoop);
    const MoeRun grouped = moe_run(m.cfg, m.named, preset, batch, model::ExpertKernels::kGrouped);
    EXPECT_TRUE(at::allclose(grouped.hidden, loop.hidden, 1e-5, 1e-6))
        << preset << ": " << (grouped.hidden - loop.hidden).abs().max().item<double>();
    EXPECT_TRUE(at::equal(replayable(m.cfg, grouped.routes), replayable(m.cfg, loop.routes))) << preset;
    EXPECT_TRUE(at::equal(grouped.load.cpu(), loop.load)) << preset;
    EXPECT_NEAR(grouped.aux.item<double>(), loop.aux.item<double>(), 1e-6) << preset;
    EXPECT_NEAR(grouped.z.item<double>(), loop.z.item<double>(), 1e-6) << preset;
    int64_t experts_with_grad = 0;
    for (const auto& [name, g] : loop.grads) {
      const at::Tensor& h = grouped.grads.at(name);
      // fp32 rounding only: the two paths sum a token's experts in different orders.
      const double scale = g.norm().item<double>();
      EXPECT_LE((h - g).norm().item<double>(), 1e-5 * scale) << preset << " " << name;
      if (scale == 0) EXPECT_EQ(h.abs().max().item<double>(), 0) << preset << " " << name;
      experts_with_grad += name.find(".experts.") != std::string::npos && g.abs().max().item<double>() > 0;
    }
    EXPECT_GT(experts_with_grad, 0) << preset;
  }
}

// The engine with grouped experts generates what it does with the loop (fp32, CPU): the same greedy
// tokens, log-probs within rounding, and the same recorded routes.
TEST(GroupedExperts, TheEngineGeneratesAsWithTheLoop) {
  TinyModel m = tiny("tiny-qwen2-moe", 2);
  const auto ps = prompts(8, 4, m.cfg.vocab_size, 30);
  auto run = [&](model::ExpertKernels kernels) {
    model::ScopedExpertKernels use(kernels);
    EngineOptions o = small_options(40);
    o.limits.max_num_seqs = 5;
    o.record_routes = true;
    Engine e(m.cfg, m.weights, o);
    for (size_t i = 0; i < ps.size(); ++i) {
      SamplingParams p;
      p.greedy = true;
      p.max_new_tokens = 4 + static_cast<int64_t>(i % 3) * 5;
      e.add({i, ps[i], p, 1});
    }
    return run_all(e);
  };
  const auto loop = run(model::ExpertKernels::kLoop);
  const auto grouped = run(model::ExpertKernels::kGrouped);
  ASSERT_EQ(loop.size(), grouped.size());
  for (const auto& [key, a] : loop) {
    const SampleOutput& b = grouped.at(key);
    EXPECT_EQ(a.tokens, b.tokens) << "request " << key.first;
    ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
    for (size_t j = 0; j < a.logprobs.size(); ++j) EXPECT_NEAR(a.logprobs[j], b.logprobs[j], 1e-4);
    EXPECT_EQ(a.routes, b.routes) << "request " << key.first;
    EXPECT_GT(b.route_width, 0);
  }
}

// On CUDA in bf16 (ATen's CUTLASS grouped GEMM on Hopper): the grouped experts equal the loop in
// the forward and the gradients, within bf16 rounding, at a tiny shape and at Qwen3-30B-A3B's
// (one block: 128 experts of 768, top 8); the engine captures its MoE decode steps in CUDA graphs,
// and its log-probs and recorded routes match the trainer's forward of the same tokens.
TEST(EngineGpu, GroupedExpertsEqualTheLoopAndDecodeUnderCudaGraphs) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  const at::Device cuda(at::kCUDA, 0);
  for (const std::string preset : {"tiny-qwen3-moe", "qwen3-30b-a3b"}) {
    TinyModel m;
    m.cfg = model::preset(preset);
    // The real shape at its own initializer range (0.02): wider weights in a 2048-wide block make
    // the hidden states so large that the experts' gradients (1e-10) drown in bf16 rounding.
    if (preset == "qwen3-30b-a3b") m.cfg.num_layers = 1;
    else m.cfg.initializer_range = 0.25;
    m.named = model::init_weights(m.cfg, model::Head::kLm, 3, at::kFloat);
    for (auto& [name, t] : m.named) t = t.to(cuda, at::kBFloat16);
    m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, preset);
    ASSERT_TRUE(model::grouped_experts(m.cfg, at::kBFloat16, cuda)) << preset;
    const auto seqs = prompts(preset == "tiny-qwen3-moe" ? 6 : 12, 9, m.cfg.vocab_size, 60);
    // Every gradient within bf16 rounding of the loop's; an expert no token chose gets none.
    auto compare_grads = [&](const MoeRun& loop, const MoeRun& grouped, const std::string& what) {
      double worst = 0;
      std::string worst_name;
      int64_t unused = 0;
      for (const auto& [name, g] : loop.grads) {
        const at::Tensor x = grouped.grads.at(name).to(at::kFloat), y = g.to(at::kFloat);
        const double n = y.norm().item<double>();
        if (n == 0) {
          ++unused;
          EXPECT_EQ(x.abs().max().item<double>(), 0) << what << ": " << name << " has a gradient, the loop's is 0";
          continue;
        }
        const double r = ((x - y).norm() / n).item<double>();
        if (r > worst) worst = r, worst_name = name;
      }
      std::printf("[grouped experts] %s: worst gradient relative difference %.3g (%s), %lld parameters unused\n",
                  what.c_str(), worst, worst_name.c_str(), static_cast<long long>(unused));
      EXPECT_LT(worst, 2e-2) << what << " " << worst_name;
      return unused;
    };
    model::PackedBatch batch = model::PackedBatch::pack(seqs, cuda);
    const MoeRun loop = moe_run(m.cfg, m.named, preset, batch, model::ExpertKernels::kLoop);
    const MoeRun grouped = moe_run(m.cfg, m.named, preset, batch, model::ExpertKernels::kGrouped);
    const at::Tensor a = grouped.hidden.to(at::kFloat), b = loop.hidden.to(at::kFloat);
    const double rel = ((a - b).norm() / b.norm()).item<double>();
    std::printf("[grouped experts] %s: hidden relative difference %.3g, max %.3g\n", preset.c_str(), rel,
                (a - b).abs().max().item<double>());
    EXPECT_LT(rel, 2e-2) << preset;
    // The first sparse layer routes the same inputs: the same experts.
    EXPECT_TRUE(at::equal(grouped.routes[0].cpu(), loop.routes[0].cpu())) << preset;
    EXPECT_TRUE(at::equal(grouped.load.cpu().select(0, 0), loop.load.select(0, 0))) << preset;
    compare_grads(loop, grouped, preset);
    // Replayed routes onto the first quarter of the experts (random, distinct per row): the others
    // get no tokens, their groups are empty, and their gradients stay zero.
    const int64_t t = batch.num_tokens(), k = m.cfg.experts_per_token, quarter = m.cfg.num_experts / 4;
    batch.routes = std::get<1>(at::rand({t * model::sparse_layers(m.cfg), quarter}).sort(int64_t{1}))
                       .narrow(1, 0, k)
                       .view({t, model::sparse_layers(m.cfg), k})
                       .to(at::kShort)
                       .contiguous();
    const int64_t unused = compare_grads(moe_run(m.cfg, m.named, preset, batch, model::ExpertKernels::kLoop),
                                         moe_run(m.cfg, m.named, preset, batch, model::ExpertKernels::kGrouped),
                                         preset + " on a quarter of the experts");
    EXPECT_GE(unused, 3 * (m.cfg.num_experts - quarter)) << preset;
  }
  // The engine: decode steps captured (grouped experts), log-probs against the trainer's forward.
  TinyModel m = tiny("tiny-qwen3-moe", 4);
  for (auto& [name, t] : m.named) t = t.to(cuda, at::kBFloat16);
  m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, "tiny-qwen3-moe");
  const auto ps = prompts(10, 6, m.cfg.vocab_size, 30);
  EngineOptions o = small_options(200);
  o.device = "cuda:0";
  o.limits.max_num_seqs = 10;
  o.limits.max_batched_tokens = 64;
  o.record_routes = true;
  Engine e(m.cfg, m.weights, o);
  ASSERT_TRUE(e.cuda_graphs()) << "a mixture of experts with grouped experts decodes in CUDA graphs";
  for (size_t i = 0; i < ps.size(); ++i) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.seed = 5 * i + 1;
    p.max_new_tokens = 12 + static_cast<int64_t>(i % 3) * 4;
    e.add({i, ps[i], p, 1});
  }
  const auto out = run_all(e);
  ASSERT_EQ(out.size(), ps.size());
  const int64_t width = model::sparse_layers(m.cfg) * m.cfg.experts_per_token;
  int64_t tokens = 0, differing_routes = 0, compared = 0;
  double worst = 0;
  c10::AutoGradMode no_grad(false);
  for (const auto& [key, s] : out) {
    std::vector<int64_t> seq = ps[key.first];
    seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
    const Routed t = forward_routed(m.cfg, m.weights, model::PackedBatch::pack({seq}, cuda));
    const auto p = static_cast<int64_t>(ps[key.first].size()), g = static_cast<int64_t>(s.tokens.size());
    const at::Tensor lp = model::token_logprobs(t.hidden.narrow(0, p - 1, g), m.weights.lm_head,
                                                at::tensor(s.tokens, at::kLong).to(cuda), 1.0)
                              .cpu();
    const int64_t n = static_cast<int64_t>(seq.size()) - 1;
    ASSERT_EQ(static_cast<int64_t>(s.routes.size()), n * width);
    const at::Tensor mine = replayable(m.cfg, t.routes).view({-1, width}).narrow(0, 0, n).cpu();
    const at::Tensor engine = at::from_blob(const_cast<int16_t*>(s.routes.data()), {n, width}, at::kShort);
    const at::Tensor differs = (mine != engine).any(1);
    differing_routes += differs.sum().item<int64_t>();
    tokens += n;
    // From the first row that took other experts (a bf16 near-tie in a router) on, the two
    // forwards differ by more than rounding (that row's output, then the keys it left); before
    // it, they must agree as a dense model's do.
    const at::Tensor first = differs.nonzero();
    const int64_t alike = first.numel() > 0 ? first[0][0].item<int64_t>() : n;
    for (int64_t j = 0; j < g; ++j) {
      if (p - 1 + j >= alike) break;
      worst = std::max(worst, std::abs(lp[j].item<double>() - s.logprobs[j]));
      ++compared;
    }
  }
  std::printf("[grouped experts] engine under CUDA graphs: worst log-prob difference %.3g over %lld tokens routed "
              "alike; %lld of %lld tokens routed differently from the trainer's forward\n",
              worst, static_cast<long long>(compared), static_cast<long long>(differing_routes),
              static_cast<long long>(tokens));
  EXPECT_GT(compared, 80);
  EXPECT_LT(worst, 0.1);
  EXPECT_LE(differing_routes * 20, tokens);  // bf16 near-ties only
}

}  // namespace
}  // namespace tiller::engine
