#include "engine/model_runner.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "core/bitwise_rules.h"

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/paged_attention.h"
#include "model/cuda/aten_dtype.h"
#endif

#include "engine/paged_kv.h"
#include "engine/runner_weights.h"
#include "model/host_upload.h"
#include "tiller/model/lora.h"
#include "tiller/model/storage_swap.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/communicator.h"
#include "tiller/model/numerics.h"
#include "tiller/model/sampling.h"
#include "tiller/model/transformer.h"

namespace tiller::engine {
#ifdef TILLER_HAVE_CUDA_KERNELS
namespace cuda = model::cuda;  // the kernels (src/model/cuda/)
using model::cuda::kernel_dtype;
#endif
namespace {

bool is_iota(const std::vector<int64_t>& rows) {
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i] != static_cast<int64_t>(i)) return false;
  return true;
}

}  // namespace

struct ModelRunner::Impl {
  model::ModelConfig global;
  model::ModelConfig local;
  model::ModelWeights weights;
  model::Rope rope;
  dist::Communicator* tp = nullptr;
  int64_t block_size = 0;
  at::Device device;
  at::Tensor cache;
  at::Tensor cache_scale;           // an FP8 cache's scales [layers, 2, slots, kv_heads] fp32
  bool fp8_kv = false;              // the cache holds e4m3 codes (ModelRunner's fp8_kv_cache)
  at::Tensor cos_table, sin_table;  // [max_model_len, head_dim] unless RoPE is dynamic
  bool paged = false;               // decode steps through the paged kernel
  bool paged_rope = false;          // ... which also applies RoPE (PagedKv::rotate_with)
  bool fp8_fused = true;            // CacheOptions::fp8_fused
  int64_t pack_keys = 0;            // DecodeInputs::pack_keys: CacheOptions::decode_pack_keys, 0 when bitwise
  std::vector<int32_t> words;       // host staging of decode inputs
  std::unique_ptr<model::StorageSwap> weight_swap;  // the weights' storages (sleep level 2)
  bool fp8 = false;                                 // the projections' FP8 copies are used
  std::atomic<uint64_t> weight_drops{0};            // read by a hybrid handoff on the actor's thread

  // A launched step's draws on their way to the host: ids (int64) and log-probs (fp32), pinned
  // on CUDA, copied on a side stream so the next step's kernels need not wait for the copy; the
  // device tensors are kept until then. Undefined `tokens`: the step drew nothing.
  struct Pending {
    at::Tensor tokens, logprobs;
    at::Tensor device_tokens, device_logprobs;
    at::Tensor routes, device_routes;  // routing replay: int16 [tokens, route_width]
    int64_t route_width = 0;
#ifdef TILLER_HAVE_CUDA_KERNELS
    std::unique_ptr<at::cuda::CUDAEvent> copied;
#endif
  };
  std::deque<Pending> pending;
  // Routing replay: the forward of a sampling step records each sparse layer's experts here.
  bool record_routes = false;
  std::vector<at::Tensor>* recording = nullptr;
  at::Tensor last_drawn;  // the latest launch's sampled ids on the device (int64)

#ifdef TILLER_HAVE_CUDA_KERNELS
  struct Graph {
    int64_t splits = 1;
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    at::Tensor hidden;  // output: final-normed hidden states [bucket, hidden]
    std::vector<at::Tensor> routes;  // a mixture of experts: each sparse layer's experts [bucket, k]
  };
  bool graphs = false;
  int64_t max_graph_batch = 0, graph_rows = 0;
  at::Tensor graph_inputs;  // int32, the DecodeInputs layout for graph_rows rows
  at::cuda::MempoolId_t pool{0, 0};
  std::map<int64_t, Graph> captured;
  std::optional<c10::cuda::CUDAStream> copy_stream;  // the draws' copies to the host
  // Every capture runs on this one stream: cuBLAS keeps a workspace (32 MiB on Hopper) per stream
  // it has run on, so a fresh pool stream per capture (every wake recaptures) would add one each
  // time, up to the pool's 32 streams.
  std::optional<c10::cuda::CUDAStream> capture_stream;
#endif

  Impl(const model::ModelConfig& cfg, const model::ModelConfig& loc, model::ModelWeights w, dist::Communicator* comm,
       int64_t bs, at::Device dev)
      : global(cfg), local(loc), weights(std::move(w)), rope(cfg), tp(comm), block_size(bs), device(dev) {}

  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const std::vector<int64_t>& lens) const {
    if (!cos_table.defined()) return rope.tables(positions, weights.embed.scalar_type(), lens);
    return {cos_table.index_select(0, positions), sin_table.index_select(0, positions)};
  }

  // Embedding, the blocks and (with `norm`) the final norm of a decode batch: [rows, hidden].
  at::Tensor decode_hidden(const DecodeInputs& in, const std::vector<int64_t>& lens, bool norm) {
    const int64_t rows = in.tokens.size(0);
    PagedKv kv(cache, cache_scale, &in, block_size);
    model::BlockContext ctx;
    std::tie(ctx.cos, ctx.sin) = rope_tables(in.positions, lens);
    if (paged_rope) kv.rotate_with(ctx.cos, ctx.sin);
    ctx.attn.lens_q.assign(static_cast<size_t>(rows), 1);
    ctx.attn.max_q = 1;
    ctx.cache = &kv;
    if (tp && tp->size() > 1)
      ctx.reduce_partial_sums = [comm = tp](at::Tensor& x) { comm->all_reduce(x)->wait_on_stream(); };
    ctx.fuse_residual = true;
    ctx.fp8_fused = fp8_fused;
    ctx.recorded_routes = recording;
    at::Tensor x = model::embed(weights.embed, in.tokens);
    for (int64_t l = 0; l < local.num_layers; ++l) x = model::block_forward(local, l, weights.layers[l], x, ctx);
    if (norm && ctx.deferred.defined())
      return model::add_rms_norm(x, model::take_deferred(ctx), weights.final_norm, local.rms_norm_eps);
    if (norm) return model::final_norm(local, weights.final_norm, x);
    model::add_deferred(x, ctx);
    return x;
  }

  // A captured decode step; `routes`, when set, gets each sparse layer's experts for the batch's rows.
  at::Tensor run_decode_graph(const StepBatch& b, std::vector<at::Tensor>* routes);

  // Writes the tokens that batch.prev_rows take from the previous launch's draws into `tokens`
  // (the step's device token ids, int32 or int64), on the stream, behind that launch.
  void take_previous_draws(at::Tensor tokens, const StepBatch& b) const {
    if (b.prev_rows.empty()) return;
    const auto k = static_cast<int64_t>(b.prev_rows.size());
    TILLER_CHECK(last_drawn.defined() && b.prev_draws.size() == b.prev_rows.size(),
                 "step batch: {} tokens from a previous step that drew {}", k,
                 last_drawn.defined() ? last_drawn.size(0) : 0);
    if (is_iota(b.prev_rows) && is_iota(b.prev_draws)) {  // the same sequences in the same order
      tokens.narrow(0, 0, k).copy_(last_drawn.narrow(0, 0, k));
      return;
    }
    std::vector<int64_t> idx(b.prev_rows);
    idx.insert(idx.end(), b.prev_draws.begin(), b.prev_draws.end());
    const at::Tensor dev = model::upload(idx, device);
    tokens.index_copy_(0, dev.narrow(0, 0, k), last_drawn.index_select(0, dev.narrow(0, k, k)).to(tokens.scalar_type()));
  }
};
ModelRunner::ModelRunner(const model::ModelConfig& cfg, model::ModelWeights weights, at::Device device,
                         int64_t block_size, dist::Communicator* tp, bool fp8, model::fp8::Scaling fp8_scaling,
                         bool fp8_kv_cache)
    : local_(config_for_rank(cfg, tp ? tp->size() : 1)), device_(device) {
  if (model::batch_invariant())
    if (const std::string conflict = tiller::bitwise_engine_conflict(fp8, fp8_kv_cache, tp ? tp->size() : 1); !conflict.empty())
      throw ConfigError(conflict);
  TILLER_CHECK(block_size > 0, "block_size must be > 0");
  if (model::batch_invariant() && model::Rope(cfg).per_sequence())
    throw ConfigError("algo.logprob_match = bitwise: the model's dynamic NTK RoPE scaling grows with the sequence the "
                      "engine is still generating, so its tables differ from the trainer's; use another rope_scaling");
  TILLER_CHECK(weights.embed.defined() && weights.embed.device() == device, "engine weights must be on {}",
               device.str());
  for (const auto& [name, t] : model::named_lora(weights))
    TILLER_CHECK(t.device() == device, "LoRA adapter {} is on {}, the engine on {}", name, t.device().str(), device.str());
  {
    c10::InferenceMode guard;
    for (auto& layer : weights.layers) {
      fuse_projections(layer);
      if (fp8) quantize_layer(layer, fp8_scaling);
    }
  }
  impl_ = std::make_unique<Impl>(cfg, local_, std::move(weights), tp, block_size, device);
  impl_->fp8 = fp8;
  impl_->fp8_kv = fp8_kv_cache;
}

void ModelRunner::requantize() {
  Impl& m = *impl_;
  if (!m.fp8) return;
  TILLER_CHECK(m.pending.empty(), "requantize() with a step in flight");
  c10::InferenceMode guard;
  for (auto& layer : m.weights.layers) requantize_layer(layer);
}

bool ModelRunner::fp8() const { return impl_->fp8; }
bool ModelRunner::fp8_kv_cache() const { return impl_->fp8_kv; }

ModelRunner::~ModelRunner() = default;

model::NamedTensors ModelRunner::parameters() const {
  // LoRA adapters (engine_weights.h: bind_lora_for_tp) beside the base, under their PEFT names.
  model::NamedTensors out = model::named_weights(local_, impl_->weights, model::Head::kLm);
  for (auto& [name, t] : model::named_lora(impl_->weights)) out[name] = t;
  return out;
}

int64_t ModelRunner::block_bytes() const {
  // An FP8 cache: a byte per element and a 4-byte scale per (token, KV head).
  const int64_t per_token = impl_->fp8_kv ? local_.num_kv_heads * (local_.head_dim + 4)
                                          : local_.kv_size() * static_cast<int64_t>(impl_->weights.embed.element_size());
  return 2 * local_.num_layers * impl_->block_size * per_token;
}

int64_t ModelRunner::activation_bytes() const {
  return static_cast<int64_t>(impl_->weights.embed.element_size());
}

void ModelRunner::allocate_cache(const CacheOptions& o) {
  Impl& m = *impl_;
  TILLER_CHECK(o.num_blocks > 0, "the KV cache needs at least one block");
  TILLER_CHECK(o.max_model_len > 0, "allocate_cache: max_model_len must be > 0");
  c10::InferenceMode guard;
  const int64_t slots = o.num_blocks * m.block_size;
  // An FP8 cache is zeroed as bytes (code 0 is +0) and viewed as e4m3.
  m.cache = m.fp8_kv ? at::zeros({local_.num_layers, 2, slots, local_.num_kv_heads, local_.head_dim},
                                 m.weights.embed.options().dtype(at::kByte))
                           .view(at::kFloat8_e4m3fn)
                     : at::zeros({local_.num_layers, 2, slots, local_.num_kv_heads, local_.head_dim},
                                 m.weights.embed.options());
  if (m.fp8_kv)
    m.cache_scale = at::zeros({local_.num_layers, 2, slots, local_.num_kv_heads}, m.weights.embed.options().dtype(at::kFloat));
  num_blocks_ = o.num_blocks;
  m.fp8_fused = o.fp8_fused;
  m.pack_keys = model::batch_invariant() ? 0 : o.decode_pack_keys;
  const at::ScalarType dtype = m.weights.embed.scalar_type();
  // RoPE tables once for every position (the same values rope.tables() computes per step);
  // dynamic NTK depends on each sequence's length and stays per step.
  if (m.global.rope_scaling.type != "dynamic") {
    const at::Tensor positions = at::arange(o.max_model_len, at::TensorOptions().dtype(at::kLong).device(device_));
    std::tie(m.cos_table, m.sin_table) = m.rope.tables(positions, dtype);
  }
#ifdef TILLER_HAVE_CUDA_KERNELS
  // An FP8 cache takes bf16/fp16 queries (either kernel).
  m.paged = device_.is_cuda() && cuda::paged_decode_supports(local_.head_dim) &&
            (dtype == at::kBFloat16 || dtype == at::kHalf || (dtype == at::kFloat && !m.fp8_kv)) &&
            o.num_blocks * m.block_size < (int64_t{1} << 31);  // slots and block ids travel as int32
  // algo.logprob_match = bitwise: one KV split per query (decode_splits), so that a decode step
  // sums its keys as the trainer's attention (the same kernel, model/batch_invariant.h) does. RoPE
  // fused here gives the RoPE kernel's bits (the trainer's in the mode too: both round each
  // rope_pair to the dtype; EngineGpu.PagedDecodeRotatesLikeTheRopeKernel), so the mode fuses it.
  m.paged_rope = m.paged && o.rope_in_attention && !m.fp8_kv &&
                 cuda::paged_decode_rotates(kernel_dtype(dtype), local_.head_dim, local_.num_heads, local_.num_kv_heads);
  // A mixture of experts is captured when its experts run as grouped GEMMs on the device; the
  // per-expert loop groups the tokens on the host, which a graph cannot replay.
  m.graphs = m.paged && o.cuda_graphs && m.cos_table.defined() && !(m.tp && m.tp->size() > 1) &&
             o.max_graph_batch > 0 && (!local_.moe() || model::grouped_experts(local_, dtype, device_));
  if (m.graphs) {
    m.max_graph_batch = o.max_graph_batch;
    m.graph_rows = graph_bucket(o.max_graph_batch);
    const int64_t max_blocks = (o.max_model_len + m.block_size - 1) / m.block_size;
    m.graph_inputs = at::zeros({5 * m.graph_rows + m.graph_rows * std::min(max_blocks, o.num_blocks)},
                               at::TensorOptions().dtype(at::kInt).device(device_));
    m.pool = at::cuda::graph_pool_handle();
  }
#endif
}

void ModelRunner::release_cache() {
  Impl& m = *impl_;
  TILLER_CHECK(m.pending.empty(), "release_cache() with a step in flight");
#ifdef TILLER_HAVE_CUDA_KERNELS
  // The graphs hold the cache's and the weights' addresses, and their pool holds memory.
  m.captured.clear();
  m.graph_inputs = at::Tensor();
  m.graphs = false;
#endif
  m.last_drawn = at::Tensor();
  m.cache = at::Tensor();
  m.cache_scale = at::Tensor();
  num_blocks_ = 0;
}

void ModelRunner::set_record_routes(bool on) { impl_->record_routes = on; }

bool ModelRunner::cache_allocated() const { return impl_->cache.defined(); }

int64_t ModelRunner::cache_bytes() const {
  const Impl& m = *impl_;
  if (!m.cache.defined()) return 0;
  return m.cache.numel() * m.cache.element_size() +
         (m.cache_scale.defined() ? m.cache_scale.numel() * m.cache_scale.element_size() : 0);
}

namespace {
std::vector<at::Tensor> tensors_of(const model::NamedTensors& named) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named) out.push_back(t);
  return out;
}

// Every tensor of the weights' storage: the parameters and the FP8 copies.
std::vector<at::Tensor> weight_tensors(const model::NamedTensors& params, model::ModelWeights& w) {
  std::vector<at::Tensor> out = tensors_of(params);
  for (auto& layer : w.layers)
    for (auto [src, dst] : fp8_pairs(layer))
      if (dst->defined()) {
        out.push_back(dst->q_storage);
        out.push_back(dst->scale_storage);
      }
  return out;
}
}  // namespace

void ModelRunner::drop_weights() {
  Impl& m = *impl_;
  TILLER_CHECK(m.pending.empty(), "drop_weights() with a step in flight");
  if (!m.weight_swap) m.weight_swap = std::make_unique<model::StorageSwap>(weight_tensors(parameters(), m.weights));
  m.weight_swap->drop();
  m.weight_drops.fetch_add(1);
}

uint64_t ModelRunner::weight_drops() const { return impl_->weight_drops.load(); }

void ModelRunner::restore_weights() {
  if (impl_->weight_swap) impl_->weight_swap->reload();
}

bool ModelRunner::weights_resident() const { return !impl_->weight_swap || impl_->weight_swap->resident(); }

int64_t ModelRunner::weight_bytes() const {
  if (impl_->weight_swap) return impl_->weight_swap->bytes();
  return model::StorageSwap(weight_tensors(parameters(), impl_->weights)).bytes();
}

bool ModelRunner::paged_decode() const { return impl_->paged; }

bool ModelRunner::cuda_graphs() const {
#ifdef TILLER_HAVE_CUDA_KERNELS
  return impl_->graphs;
#else
  return false;
#endif
}

#ifdef TILLER_HAVE_CUDA_KERNELS
// Replays (capturing on first use) the graph of the batch's bucket over the static inputs:
// final-normed hidden states [bucket, hidden], valid until the next replay.
at::Tensor ModelRunner::Impl::run_decode_graph(const StepBatch& b, std::vector<at::Tensor>* routes) {
  const int64_t n = b.num_seqs(), rows = graph_bucket(n);
  fill_decode_words(b, graph_rows, block_size, words);
  const auto used = static_cast<int64_t>(words.size());
  TILLER_CHECK(used <= graph_inputs.size(0), "decode batch: {} block ids exceed the graph's {}",
               used - 5 * graph_rows, graph_inputs.size(0) - 5 * graph_rows);
  graph_inputs.narrow(0, 0, used).copy_(model::host_tensor(words, /*pinned=*/true), /*non_blocking=*/true);
  take_previous_draws(graph_inputs.narrow(0, 0, n), b);
  auto [it, fresh] = captured.try_emplace(rows);
  Graph& g = it->second;
  if (fresh) {
    DecodeInputs in = decode_views(graph_inputs, graph_rows, rows);
    in.splits = model::batch_invariant()
                    ? 1
                    : cuda::paged_decode_splits(kernel_dtype(weights.embed.scalar_type()), local.head_dim, rows,
                                                local.num_heads, local.num_kv_heads, 0, device.index());
    g.splits = in.splits;
    in.pack_keys = cuda::paged_decode_pack_keys(kernel_dtype(weights.embed.scalar_type()), local.head_dim, rows,
                                                local.num_heads, local.num_kv_heads, in.splits, pack_keys,
                                                device.index());
    const std::vector<int64_t> lens(static_cast<size_t>(rows), 1);
    if (!capture_stream) capture_stream = c10::cuda::getStreamFromPool(false, device.index());
    c10::cuda::CUDAStream side = *capture_stream;
    c10::cuda::getCurrentCUDAStream(device.index()).synchronize();  // the inputs are in place
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      // A mixture of experts records its routes in every replay (the tensors the graph writes).
      std::vector<at::Tensor>* const outer = recording;
      g.routes.assign(local.moe() ? static_cast<size_t>(local.num_layers) : 0, at::Tensor());
      recording = local.moe() ? &g.routes : nullptr;
      struct Restore {
        std::vector<at::Tensor>*& r;
        std::vector<at::Tensor>* saved;
        ~Restore() { r = saved; }
      } restore{recording, outer};
      decode_hidden(in, lens, true);  // warm-up: cuBLAS handles and workspaces for this stream
      side.synchronize();
      g.graph = std::make_unique<at::cuda::CUDAGraph>();
      g.graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      g.hidden = decode_hidden(in, lens, true);
      g.graph->capture_end();
    }
    log::debug("engine: captured the decode graph of batch {} ({} KV splits)", rows, g.splits);
  }
  g.graph->replay();
  if (routes) {
    TILLER_CHECK(g.routes.size() == routes->size(), "the decode graph of batch {} recorded no routes", rows);
    for (size_t l = 0; l < routes->size(); ++l)
      if (g.routes[l].defined()) (*routes)[l] = g.routes[l].narrow(0, 0, n);
  }
  return g.hidden;
}
#else
at::Tensor ModelRunner::Impl::run_decode_graph(const StepBatch&, std::vector<at::Tensor>*) { return {}; }
#endif

ModelRunner::Sampled ModelRunner::run(const StepBatch& b, bool sample) {
  launch(b, sample);
  return sample ? collect() : Sampled{};
}

void ModelRunner::launch(const StepBatch& b, bool sample) {
  Impl& m = *impl_;
  TILLER_CHECK(m.cache.defined(), "launch() before allocate_cache()");
  c10::InferenceMode guard;
  const int64_t n = b.num_seqs(), bs = m.block_size;
  // Copy-on-write: a sample's first write into a block it shares.
  for (const auto& c : b.copies) {
    m.cache.narrow(2, c.to * bs, c.count).copy_(m.cache.narrow(2, c.from * bs, c.count));
    if (m.cache_scale.defined())
      m.cache_scale.narrow(2, c.to * bs, c.count).copy_(m.cache_scale.narrow(2, c.from * bs, c.count));
  }
  const bool rows_all = sample && !b.sample_rows.empty();
  at::Tensor h;  // final-normed hidden states of the sample rows
  auto sample_rows = [&](const at::Tensor& x) {
    const auto count = static_cast<int64_t>(b.sample_rows.size());
    return is_iota(b.sample_rows) ? x.narrow(0, 0, count) : x.index_select(0, model::upload(b.sample_rows, device_));
  };
  bool graphs = false;
#ifdef TILLER_HAVE_CUDA_KERNELS
  graphs = m.graphs && n <= m.max_graph_batch;
#endif
  // Routing replay: the experts of every row, recorded by the forward below.
  const bool routes = sample && m.record_routes && local_.moe();
  std::vector<at::Tensor> recorded(routes ? static_cast<size_t>(local_.num_layers) : 0);
  m.recording = routes ? &recorded : nullptr;
  struct Unset {
    std::vector<at::Tensor>*& r;
    ~Unset() { r = nullptr; }
  } unset{m.recording};
  if (b.is_decode() && graphs) {
    at::Tensor all = m.run_decode_graph(b, routes ? &recorded : nullptr);
    if (rows_all) h = sample_rows(all);
  } else if (b.is_decode() && m.paged) {
    fill_decode_words(b, n, bs, m.words);
    const at::Tensor words = model::upload(m.words, device_);
    m.take_previous_draws(words.narrow(0, 0, n), b);
    DecodeInputs in = decode_views(words, n, n);
#ifdef TILLER_HAVE_CUDA_KERNELS
    in.splits = model::batch_invariant()
                    ? 1
                    : cuda::paged_decode_splits(kernel_dtype(m.weights.embed.scalar_type()), local_.head_dim, n,
                                                local_.num_heads, local_.num_kv_heads,
                                                *std::max_element(b.lens_k.begin(), b.lens_k.end()), device_.index());
    in.pack_keys = cuda::paged_decode_pack_keys(kernel_dtype(m.weights.embed.scalar_type()), local_.head_dim, n,
                                                local_.num_heads, local_.num_kv_heads, in.splits, m.pack_keys,
                                                device_.index());
#endif
    at::Tensor x = m.decode_hidden(in, b.lens_q, /*norm=*/false);
    if (rows_all) h = model::final_norm(local_, m.weights.final_norm, sample_rows(x));
  } else {
    h = run_packed(b, rows_all);
  }
  if (!sample) return;
  Impl::Pending p;
  at::Tensor routes_all;  // int16 [rows, sparse layers * k], where the forward left them
  if (routes) {
    const int64_t rows = b.num_tokens(), k = local_.experts_per_token;
    std::vector<at::Tensor> layers;
    for (int64_t l = 0; l < local_.num_layers; ++l) {
      if (!local_.sparse_layer(l)) continue;
      const at::Tensor& r = recorded[static_cast<size_t>(l)];
      TILLER_CHECK(r.defined() && r.dim() == 2 && r.size(0) == rows && r.size(1) == k,
                   "layer {} recorded no routes for {} rows", l, rows);
      layers.push_back(r);
    }
    p.route_width = static_cast<int64_t>(layers.size()) * k;
    routes_all = at::stack(layers, 1).reshape({rows, p.route_width}).to(at::kShort);
  }
  if (rows_all) {
    // Logits in the weights' dtype: the sampler reads bf16 directly (math in fp32).
    model::SampledTokens drawn = model::sample_tokens(model::lm_logits(h, m.weights.lm_head), b.sampling);
    drawn.tokens = drawn.tokens.to(at::kLong).contiguous();  // no-ops for the sampler's outputs
    drawn.logprobs = drawn.logprobs.to(at::kFloat).contiguous();
    m.last_drawn = drawn.tokens;
#ifdef TILLER_HAVE_CUDA_KERNELS
    if (device_.is_cuda()) {
      if (!m.copy_stream) m.copy_stream = c10::cuda::getStreamFromPool(false, device_.index());
      at::cuda::CUDAEvent sampled;
      sampled.record(c10::cuda::getCurrentCUDAStream(device_.index()));
      sampled.block(*m.copy_stream);
      c10::cuda::CUDAStreamGuard on_copy(*m.copy_stream);
      p.device_tokens = drawn.tokens;
      p.device_logprobs = drawn.logprobs;
      p.tokens = at::empty(drawn.tokens.sizes(), drawn.tokens.options().device(at::kCPU).pinned_memory(true));
      p.logprobs = at::empty(drawn.logprobs.sizes(), drawn.logprobs.options().device(at::kCPU).pinned_memory(true));
      p.tokens.copy_(drawn.tokens, /*non_blocking=*/true);
      p.logprobs.copy_(drawn.logprobs, /*non_blocking=*/true);
      if (routes_all.defined() && routes_all.is_cuda()) {
        p.device_routes = routes_all;
        p.routes = at::empty(routes_all.sizes(), routes_all.options().device(at::kCPU).pinned_memory(true));
        p.routes.copy_(routes_all, /*non_blocking=*/true);
      }
      p.copied = std::make_unique<at::cuda::CUDAEvent>();
      p.copied->record(*m.copy_stream);
    }
#endif
    if (!p.tokens.defined()) {
      p.tokens = drawn.tokens.cpu();
      p.logprobs = drawn.logprobs.cpu();
    }
  } else {
    m.last_drawn = at::Tensor();
  }
  if (routes_all.defined() && !p.routes.defined()) p.routes = routes_all.cpu();
  m.pending.push_back(std::move(p));
}

ModelRunner::Sampled ModelRunner::collect() {
  Impl& m = *impl_;
  TILLER_CHECK(!m.pending.empty(), "collect() without a launched step");
  Impl::Pending p = std::move(m.pending.front());
  m.pending.pop_front();
  Sampled out;
  out.route_width = p.route_width;
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (p.copied) p.copied->synchronize();
#endif
  if (p.routes.defined()) {
    const int16_t* r = p.routes.data_ptr<int16_t>();
    out.routes.assign(r, r + p.routes.numel());
  }
  if (!p.tokens.defined()) return out;
  const int64_t* t = p.tokens.data_ptr<int64_t>();
  const float* lp = p.logprobs.data_ptr<float>();
  out.tokens.assign(t, t + p.tokens.numel());
  out.logprobs.assign(lp, lp + p.logprobs.numel());
  return out;
}

// Prefill, mixed and CPU steps: packed varlen attention over gathered context.
at::Tensor ModelRunner::run_packed(const StepBatch& b, bool sample) {
  Impl& m = *impl_;
  const int64_t t = b.num_tokens(), n = b.num_seqs(), bs = m.block_size;
  // Every int64 input in one upload: tokens, positions, slots, gather, sample rows, cu_q, cu_k.
  std::vector<int64_t> words;
  words.reserve(static_cast<size_t>(4 * t + 2 * n + 2));
  words.insert(words.end(), b.tokens.begin(), b.tokens.end());
  words.insert(words.end(), b.positions.begin(), b.positions.end());
  bool cached = false;
  model::VarlenSpec spec;
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lq = b.lens_q[i], lk = b.lens_k[i];
    TILLER_CHECK(lq > 0 && lk >= lq && static_cast<int64_t>(b.tables[i].size()) * bs >= lk,
                 "step batch: sequence {} has {} new of {} tokens in {} blocks", i, lq, lk, b.tables[i].size());
    for (int64_t s = lk - lq; s < lk; ++s) words.push_back(b.tables[i][s / bs] * bs + s % bs);
    cached |= lk > lq;
    cu_q.push_back(cu_q.back() + lq);
    cu_k.push_back(cu_k.back() + lk);
    spec.max_q = std::max(spec.max_q, lq);
    spec.max_k = std::max(spec.max_k, lk);
  }
  TILLER_CHECK(cu_q.back() == t, "step batch: query lengths cover {} of {} tokens", cu_q.back(), t);
  const int64_t gather_len = cached ? cu_k.back() : 0;
  for (int64_t i = 0; i < n && cached; ++i)
    for (int64_t s = 0; s < b.lens_k[i]; ++s) words.push_back(b.tables[i][s / bs] * bs + s % bs);
  words.insert(words.end(), b.sample_rows.begin(), b.sample_rows.end());
  words.insert(words.end(), cu_q.begin(), cu_q.end());
  words.insert(words.end(), cu_k.begin(), cu_k.end());
  at::Tensor dev = model::upload(words, device_);
  int64_t at_word = 0;
  auto take = [&](int64_t len) {
    at::Tensor v = dev.narrow(0, at_word, len);
    at_word += len;
    return v;
  };
  at::Tensor tokens = take(t), positions = take(t), slots = take(t), gather = take(gather_len);
  m.take_previous_draws(tokens, b);
  at::Tensor rows = take(static_cast<int64_t>(b.sample_rows.size()));
  spec.cu_q = take(n + 1).to(at::kInt);
  spec.cu_k = take(n + 1).to(at::kInt);
  spec.lens_q = b.lens_q;
  spec.lens_k = b.lens_k;

  PagedKv kv(m.cache, m.cache_scale, slots, cached ? gather : at::Tensor());
  model::BlockContext ctx;
  std::tie(ctx.cos, ctx.sin) = m.rope_tables(positions, b.lens_q);
  ctx.attn = spec;
  ctx.cache = &kv;
  if (m.tp && m.tp->size() > 1)
    ctx.reduce_partial_sums = [comm = m.tp](at::Tensor& x) { comm->all_reduce(x)->wait_on_stream(); };
  ctx.fuse_residual = true;
  ctx.fp8_fused = m.fp8_fused;
  ctx.recorded_routes = m.recording;
  at::Tensor x = model::embed(m.weights.embed, tokens);
  for (int64_t l = 0; l < local_.num_layers; ++l) x = model::block_forward(local_, l, m.weights.layers[l], x, ctx);
  if (!sample) return {};
  model::add_deferred(x, ctx);
  return model::final_norm(local_, m.weights.final_norm, x.index_select(0, rows));
}

}  // namespace tiller::engine
