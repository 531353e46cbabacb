#include "engine/engine_impl.h"

#include <random>
#include <thread>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "engine/kv_sizing.h"
#include "model/torch_compat.h"
#include "tiller/dist/watchdog.h"
#include "tiller/model/fp8.h"

namespace tiller::engine {

void Engine::Impl::broadcast(Message kind, std::vector<int64_t> words) {
  if (!tensor_parallel()) return;
  const at::Device where = control_device();
  std::vector<int64_t> head{static_cast<int64_t>(kind), static_cast<int64_t>(words.size())};
  at::Tensor h = at::from_blob(head.data(), {2}, at::kLong).to(where, false, /*copy=*/true);
  ctl()->broadcast(h, 0)->wait();
  if (words.empty()) return;
  at::Tensor w = at::from_blob(words.data(), {static_cast<int64_t>(words.size())}, at::kLong).to(where, false, true);
  ctl()->broadcast(w, 0)->wait();
}

void Engine::Impl::quiesce() const {
  if (stream) stream->synchronize();
}

void Engine::Impl::validate(const Request& r) const {
  auto bad = [&](const std::string& what) {
    throw InvalidRequest(fmt::format("request {}: {}", r.id, what));
  };
  if (requests.count(r.id)) bad("the id is already in use by a live request");
  if (r.prompt.empty()) bad("the prompt is empty");
  for (size_t i = 0; i < r.prompt.size(); ++i)
    if (r.prompt[i] < 0 || r.prompt[i] >= cfg.vocab_size)
      bad(fmt::format("prompt token {} is {}, outside the vocabulary [0, {})", i, r.prompt[i], cfg.vocab_size));
  for (int64_t id : r.params.stop_token_ids)
    if (id < 0 || id >= cfg.vocab_size)
      bad(fmt::format("stop token id {} is outside the vocabulary [0, {})", id, cfg.vocab_size));
  try {
    r.params.validate();
  } catch (const ConfigError& e) {
    bad(e.what());
  }
  if (r.n < 1 || r.n > opts.limits.max_num_seqs)
    bad(fmt::format("n = {} samples; allowed 1 to max_num_seqs = {}", r.n, opts.limits.max_num_seqs));
  if (r.resume && r.n != 1) bad(fmt::format("n = {}: a request that resumes a session continues one sample", r.n));
  // Both terms are bounded (the prompt by max_model_len, max_new_tokens by validate()), so the
  // sum cannot wrap and pass the checks below.
  const auto prompt = static_cast<int64_t>(r.prompt.size());
  if (prompt > max_model_len) bad(fmt::format("the prompt has {} tokens; max_model_len is {}", prompt, max_model_len));
  const int64_t total = checked_add(prompt, r.params.max_new_tokens, "prompt + max_new_tokens");
  if (total > max_model_len)
    bad(fmt::format("prompt ({}) + max_new_tokens ({}) = {} exceeds max_model_len {}", prompt,
                    r.params.max_new_tokens, total, max_model_len));
  if (kv->blocks_for(total) > kv->num_blocks())
    bad(fmt::format("{} tokens need {} KV blocks; the cache has {}", total, kv->blocks_for(total), kv->num_blocks()));
  if (!opts.limits.chunked_prefill && total > opts.limits.max_batched_tokens)
    bad(fmt::format("prompt + max_new_tokens = {} exceeds max_batched_tokens {} (chunked prefill is off)", total,
                    opts.limits.max_batched_tokens));
}

SampleOutput Engine::Impl::finish(Sequence& s, const char* reason, bool keep) {
  SampleOutput o;
  o.request_id = s.request;
  o.sample = s.sample;
  o.tokens.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
  o.logprobs = std::move(s.logprobs);
  o.finish_reason = reason;
  o.prompt_tokens = s.prompt_len;
  o.preemptions = s.preemptions;
  o.version_starts = std::move(s.version_starts);
  o.versions = std::move(s.versions);
  if (s.route_width > 0) {  // every row but the last token's, which nothing computed
    // A sample aborted mid-prefill has rows nothing computed yet: -1, they route themselves.
    const auto n = static_cast<size_t>((static_cast<int64_t>(s.tokens.size()) - 1) * s.route_width);
    o.routes.assign(s.routes.begin(), s.routes.begin() + static_cast<std::ptrdiff_t>(std::min(n, s.routes.size())));
    o.routes.resize(n, -1);
    o.route_width = s.route_width;
  }
  if (!keep) kv->release(s.table);
  auto it = requests.find(s.request);
  // An unforked prompt finishing early takes its pending samples with it (abort only).
  it->second.live -= 1 + s.pending_forks;
  if (it->second.live <= 0) {
    requests.erase(it);
    ++stats.requests_finished;
  }
  return o;
}

Engine::Engine(const model::ModelConfig& cfg, model::ModelWeights weights, const EngineOptions& opts,
               dist::Communicator* tp, dist::Communicator* control)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.cfg = cfg;
  m.opts = opts;
  m.tp = tp;
  if (control && (!tp || control->size() != tp->size() || control->rank() != tp->rank()))
    throw ConfigError(fmt::format("engine: the control communicator '{}' ({} ranks, rank {}) is not the TP group's "
                                  "({} ranks, rank {})",
                                  control->name(), control->size(), control->rank(), tp ? tp->size() : 1,
                                  tp ? tp->rank() : 0));
  m.control = control;
  const int tp_size = tp ? tp->size() : 1;
  if (cfg.num_heads % tp_size || cfg.num_kv_heads % tp_size || cfg.intermediate_size % tp_size)
    throw ConfigError(fmt::format("tensor parallel size {} must divide the attention heads ({}), the KV heads ({}) "
                                  "and the MLP width ({})",
                                  tp_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size));
  // The RoPE tables and the graphs' block lists are sized by max_model_len: bound it before any
  // allocation, so an absurd value is a message and not an allocation failure.
  const int64_t max_len = opts.max_model_len > 0 ? opts.max_model_len : cfg.max_position_embeddings;
  if (max_len < 1 || max_len > kMaxModelLen)
    throw ConfigError(fmt::format("max_model_len = {} is out of range: must be in [1, {}]", max_len, kMaxModelLen));
  // Past the positions the model was trained for, RoPE extrapolates: only a scaling that says so
  // (rope_scaling in config.json) allows it.
  if (max_len > model::context_limit(cfg))
    throw ConfigError(fmt::format("max_model_len = {} exceeds the model's context of {} tokens (max_position_embeddings "
                                  "{}, rope_scaling '{}' x {}); lower it, or give config.json a rope_scaling that "
                                  "covers it",
                                  max_len, model::context_limit(cfg), cfg.max_position_embeddings,
                                  cfg.rope_scaling.type, cfg.rope_scaling.factor));
  const at::Device device(opts.device);
  if (opts.record_routes && !cfg.moe())
    throw ConfigError("routing replay (algo.routing_replay) needs a mixture-of-experts model; this one is dense");
  if (opts.record_routes && cfg.num_experts > 32767)
    throw ConfigError(fmt::format("routing replay records experts as int16; the model has {} experts (at most 32767)",
                                  cfg.num_experts));
  if (opts.quantization != "none" && opts.quantization != "fp8")
    throw ConfigError(fmt::format("engine quantization '{}': use none or fp8", opts.quantization));
  const bool fp8 = opts.quantization == "fp8";
  const model::fp8::Scaling scaling = model::fp8::parse_scaling(opts.fp8_scaling, "engine fp8 scaling");
  if (opts.kv_cache_dtype != "auto" && opts.kv_cache_dtype != "fp8")
    throw ConfigError(fmt::format("engine KV cache dtype '{}': use auto or fp8", opts.kv_cache_dtype));
  const bool fp8_kv = opts.kv_cache_dtype == "fp8";
  if (opts.decode_pack_keys < 0 || opts.decode_pack_keys > (int64_t{1} << 20))
    throw ConfigError(fmt::format("engine decode_pack_keys = {} is out of range: must be in [0, {}]",
                                  opts.decode_pack_keys, int64_t{1} << 20));
  m.runner = std::make_unique<ModelRunner>(cfg, std::move(weights), device, opts.block_size, tp, fp8, scaling, fp8_kv);
  m.runner->set_record_routes(opts.record_routes);
  int64_t blocks = opts.num_blocks;
  if (blocks <= 0 && opts.kv_cache_gb > 0)
    blocks = static_cast<int64_t>(opts.kv_cache_gb * (1ull << 30)) / m.runner->block_bytes();
  if (blocks <= 0 && device.is_cuda()) {
    // Memory that PyTorch's allocator caches but no tensor uses (an engine or a trainer step
    // before this one) is free for the cache too: handed back first, or the device would not count
    // it (a second engine in one process got 13 of 127 free GiB without this).
    model::release_cached_device_memory(device);
    const int64_t free_bytes = model::device_free_bytes(device);
    // A step of max_batched_tokens keeps room for its activations (kv_sizing.h), whatever the fraction.
    const int64_t reserve = step_activation_bytes(cfg, opts.limits.max_batched_tokens, m.runner->activation_bytes(),
                                                  tp_size, opts.limits.max_num_seqs) +
                            (int64_t{512} << 20);
    blocks = kv_blocks_for(free_bytes, opts.gpu_memory_fraction, m.runner->block_bytes(), reserve);
    const auto gib = [](int64_t b) { return static_cast<double>(b) / (1ull << 30); };
    if (blocks <= 0)
      throw ConfigError(fmt::format("engine: a step of engines.max_batched_tokens = {} tokens needs up to {:.1f} GiB of "
                                    "activations beside the weights, and {:.1f} GiB are free on {}: lower "
                                    "engines.max_batched_tokens, or give the engine more memory",
                                    opts.limits.max_batched_tokens, gib(reserve), gib(free_bytes), device.str()));
    if (static_cast<double>(free_bytes - reserve) < static_cast<double>(free_bytes) * opts.gpu_memory_fraction)
      log::info("engine: the KV cache leaves {:.1f} GiB of the {:.1f} free for a step's activations "
                "(engines.max_batched_tokens = {}), more than engines.gpu_memory_fraction = {} would",
                gib(reserve), gib(free_bytes), opts.limits.max_batched_tokens, opts.gpu_memory_fraction);
  }
  if (blocks <= 0) blocks = static_cast<int64_t>(1ull << 30) / m.runner->block_bytes();
  if (m.tensor_parallel()) {  // every rank of the group holds the same number of blocks
    at::Tensor b = at::full({1}, blocks, at::kLong).to(m.control_device());
    m.ctl()->all_reduce(b, dist::ReduceOp::kMin)->wait();
    blocks = b.item<int64_t>();
  }
  m.max_model_len = opts.max_model_len > 0 ? opts.max_model_len : cfg.max_position_embeddings;
  ModelRunner::CacheOptions cache;
  cache.num_blocks = blocks;
  cache.max_model_len = m.max_model_len;
  cache.cuda_graphs = opts.cuda_graphs;
  cache.rope_in_attention = opts.rope_in_attention;
  cache.decode_pack_keys = opts.decode_pack_keys;
  cache.fp8_fused = opts.fp8_fused;
  cache.max_graph_batch =
      opts.max_graph_batch > 0 ? opts.max_graph_batch : std::min<int64_t>(opts.limits.max_num_seqs, 512);
  m.cache_options = cache;
  if (!opts.start_asleep) m.runner->allocate_cache(cache);
  m.kv = std::make_unique<KvBlockManager>(blocks, opts.block_size);
  m.stats.kv_blocks_total = blocks;
  if (opts.own_stream && device.is_cuda()) {
    // What the constructor queued on this thread's stream (the weights, the cache) is complete
    // before the engine's stream touches it.
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->synchronizeDevice(device.index());
    m.stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  }
  log::info("engine: {} KV blocks of {} tokens ({:.2f} GiB{}), max_model_len {}, tp {}, decode: {}{}{}{}", blocks,
            opts.block_size, static_cast<double>(blocks * m.runner->block_bytes()) / (1ull << 30),
            fp8_kv ? ", FP8 e4m3 with a scale per token and KV head" : "", m.max_model_len,
            tp_size, m.runner->paged_decode() ? "paged kernel" : "gathered context",
            m.runner->cuda_graphs() ? fmt::format(", CUDA graphs up to batch {}", cache.max_graph_batch) : "",
            opts.start_asleep ? " (asleep: the cache is allocated at wake)" : "",
            !fp8                               ? ""
            : model::fp8::tensor_cores(device)
                ? fmt::format(", FP8 projections ({} scales) on tensor cores", opts.fp8_scaling)
                : fmt::format(", FP8 projections ({} scales) emulated (no FP8 tensor cores here)", opts.fp8_scaling));
}

Engine::~Engine() {
  try {
    if (impl_ && impl_->leader()) shutdown();
  } catch (const std::exception& e) {
    log::warn("engine shutdown: {}", e.what());
  }
}

const model::ModelConfig& Engine::config() const { return impl_->cfg; }
const EngineOptions& Engine::options() const { return impl_->opts; }
int64_t Engine::max_model_len() const { return impl_->max_model_len; }
bool Engine::paged_decode() const { return impl_->runner->paged_decode(); }
bool Engine::cuda_graphs() const { return impl_->runner->cuda_graphs(); }
bool Engine::is_leader() const { return impl_->leader(); }

void Engine::use_device_on_this_thread() const {
  const at::Device d(impl_->opts.device);
  if (d.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(d);
}
int Engine::tp_size() const { return impl_->tp ? impl_->tp->size() : 1; }
int Engine::tp_rank() const { return impl_->tp ? impl_->tp->rank() : 0; }

std::map<std::string, at::Tensor> Engine::parameters() const { return impl_->runner->parameters(); }

void Engine::set_weight_sink(WeightSink* sink) { impl_->sink = sink; }
WeightSink* Engine::weight_sink() const { return impl_->sink; }

std::string WeightSink::take_chunk(const WeightChunk&, double) {
  throw InvalidRequest("this engine takes its weights over the sync communicator of its job, not pushed chunks");
}

const std::string& Engine::weights_broken() const { return impl_->broken; }

uint64_t Engine::weight_version() const { return impl_->weight_version; }

void Engine::weights_updated(uint64_t version) {
  Impl& m = *impl_;
  TILLER_CHECK(m.leader() && !m.shut_down, "weights_updated() on a TP follower or after shutdown()");
  TILLER_CHECK(!m.in_flight, "weights_updated() with a step in flight: drain() first");
  m.weight_version = version;
  m.drop_all_parked();  // their keys and values are of the old weights
  // Every sequence with keys and values of the old weights starts over from its first token (its
  // sampled tokens and their log-probs stay); the scheduler admits it again oldest first, as it
  // does a preempted one.
  for (int64_t id : std::vector<int64_t>(m.running)) {
    Sequence& s = m.seqs.at(id);
    m.kv->release(s.table);
    s.num_computed = 0;
    ++m.stats.kv_rebuilds;
    erase_id(m.running, id);
    insert_by_age(m.waiting, id);
  }
}

double Engine::requantize() {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  TILLER_CHECK(!m.in_flight, "requantize() with a step in flight: drain() first");
  const auto t0 = std::chrono::steady_clock::now();
  m.runner->requantize();
  compat::synchronize(m.runner->device());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

uint64_t Engine::install_sync_plan(const std::string& plan) {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  TILLER_CHECK(m.leader() && !m.shut_down, "install_sync_plan() on a TP follower or after shutdown()");
  if (!m.sink)
    throw InvalidRequest("this engine takes no weight sync: it has no sync communicator (engines started by "
                         "tiller train have one; a standalone tiller engine does not)");
  uint64_t id = 0;
  try {
    id = m.sink->install_plan(plan);
  } catch (const ConfigError& e) {
    throw InvalidRequest(e.what());
  }
  m.broadcast(Message::kSyncPlan, to_words(plan));
  return id;
}

WeightSink::Result Engine::Impl::receive_weights(uint64_t version) {
  WeightSink::Result r;
  quiesce();  // the sink writes the weights from another thread (the hybrid handoff), on its stream
  if (sink) {
    r = sink->receive(version);
    // An FP8 engine's projections follow the weights the sync wrote (each rank its own slices).
    if (r.complete && r.base_changed) runner->requantize();
  } else {
    r.error = fmt::format("weight sync to version {}: TP rank {} has no weight sink", version, tp ? tp->rank() : 0);
  }
  if (tensor_parallel()) {
    // Complete only if every rank completed; changed if any rank wrote.
    at::Tensor f = at::tensor(std::vector<int64_t>{r.complete ? 0 : 1, r.weights_changed ? 1 : 0}, at::kLong)
                       .to(control_device());
    ctl()->all_reduce(f, dist::ReduceOp::kMax)->wait();
    f = f.cpu();
    if (r.complete && f[0].item<int64_t>() != 0) {
      r.complete = false;
      r.error = fmt::format("weight sync to version {} failed on another TP rank of this engine (see its log)", version);
    }
    r.weights_changed = f[1].item<int64_t>() != 0;
  }
  if (r.complete) {
    broken.clear();
  } else if (r.weights_changed) {
    broken = fmt::format("the weights are incomplete after a failed sync ({}); run a new sync", r.error);
  }
  if (!r.error.empty()) log::error("{}", r.error);
  return r;
}

WeightSink::Result Engine::receive_weights(uint64_t version) {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  TILLER_CHECK(m.leader() && !m.shut_down, "receive_weights() on a TP follower or after shutdown()");
  TILLER_CHECK(!m.in_flight, "receive_weights() with a step in flight: drain() first");
  m.broadcast(Message::kSync, {static_cast<int64_t>(version)});
  return m.receive_weights(version);
}

void Engine::Impl::sleep_here(int level) {
  runner->release_cache();
  if (level >= 2 && runner->weights_resident()) {
    runner->drop_weights();
    broken = "the weights were freed by sleep level 2; a weight sync refills them";
  }
  // The freed cache (and weights) go back to the driver: the trainer of a hybrid process, its NCCL
  // buffers and the next wake's one-piece cache then find whole free memory, not the cache's blocks.
  model::release_cached_device_memory(runner->device());
}

void Engine::Impl::wake_here(bool weights, bool cache) {
  // What the process's other phase left cached (a hybrid trainer's blocks) goes back first: the
  // weights and the cache are large single allocations.
  if ((weights && !runner->weights_resident()) || (cache && !runner->cache_allocated()))
    model::release_cached_device_memory(runner->device());
  if ((weights || cache) && !runner->weights_resident()) runner->restore_weights();
  if (cache && !runner->cache_allocated()) runner->allocate_cache(cache_options);
}

void Engine::sleep(int level) {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  TILLER_CHECK(m.leader() && !m.shut_down, "sleep() on a TP follower or after shutdown()");
  if (level < 1 || level > 2) throw InvalidRequest(fmt::format("sleep level {}: must be 1 (the KV cache) or 2 (and "
                                                               "the weights)", level));
  if (m.in_flight || !m.seqs.empty() || !m.aborted.empty())
    throw InvalidRequest(fmt::format("cannot sleep with {} live sequences: finish or abort them first",
                                     m.seqs.size()));
  m.drop_all_parked();
  m.broadcast(Message::kSleep, {level});
  m.sleep_here(level);
}

void Engine::wake(bool weights, bool cache) {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  TILLER_CHECK(m.leader() && !m.shut_down, "wake() on a TP follower or after shutdown()");
  m.broadcast(Message::kWake, {weights ? 1 : 0, cache ? 1 : 0});
  m.wake_here(weights, cache);
}

int Engine::sleep_level() const {
  const ModelRunner& r = *impl_->runner;
  return !r.weights_resident() ? 2 : r.cache_allocated() ? 0 : 1;
}

uint64_t Engine::weight_drops() const { return impl_->runner->weight_drops(); }

EngineMemory Engine::memory() const {
  const ModelRunner& r = *impl_->runner;
  EngineMemory out;
  out.weight_bytes = r.weights_resident() ? r.weight_bytes() : 0;
  out.kv_cache_bytes = r.cache_bytes();
  out.sleep_level = sleep_level();
  const model::DeviceMemory d = model::device_memory(r.device());
  out.device_allocated = d.allocated;
  out.device_reserved = d.reserved;
  return out;
}

void Engine::add(Request r) {
  Impl& m = *impl_;
  TILLER_CHECK(m.leader() && !m.shut_down, "add() on a TP follower or after shutdown()");
  if (!m.broken.empty()) throw InvalidRequest(fmt::format("request {}: {}", r.id, m.broken));
  if (!m.runner->cache_allocated())
    throw InvalidRequest(fmt::format("request {}: the engine is asleep (no KV cache); wake it first", r.id));
  m.validate(r);
  m.expire_sessions();
  Sequence s;
  s.id = m.next_id++;
  s.request = r.id;
  s.pending_forks = r.n - 1;
  s.tokens = r.prompt;
  s.prompt_len = static_cast<int64_t>(r.prompt.size());
  bool resumed = false, deferred = false;
  if (r.resume) {
    // The cached prefix this prompt shares with the session, leaving at least the prompt's last
    // token to compute (its row gives the first draw).
    // (A session another waiting resume has claimed is not shared: this one is a miss.)
    if (auto k = m.session_ids.find(r.session); k != m.session_ids.end() && !m.parked.at(k->second).claimed) {
      const int64_t pid = k->second;
      Sequence& old = m.parked.at(pid).seq;
      const int64_t limit = std::min<int64_t>(old.num_computed, s.prompt_len - 1);
      int64_t common = 0;
      while (common < limit && old.tokens[static_cast<size_t>(common)] == s.tokens[static_cast<size_t>(common)]) ++common;
      // Straight to running, holding its blocks, when a seat is free; else it waits for one with
      // the session claimed (resumes take freed seats before waiting prompts).
      if (common > 0 && m.running_seats() < m.opts.limits.max_num_seqs && m.resuming.empty()) {
        m.adopt(s, pid, common);
        resumed = true;
      } else if (common > 0) {
        s.resume_parked = pid;
        s.resume_common = common;
        m.parked.at(pid).claimed = true;
        deferred = true;
      } else {
        m.drop_parked(pid, false);
      }
    }
    if (!resumed && !deferred) ++m.stats.session_misses;
  }
  RequestState state;
  state.live = r.n;
  state.req = std::move(r);
  m.requests.emplace(state.req.id, std::move(state));
  if (resumed) m.running.push_back(s.id);  // the newest id
  else if (deferred) m.resuming.push_back(s.id);
  else m.waiting.push_back(s.id);
  m.seqs.emplace(s.id, std::move(s));
}

bool Engine::abort(uint64_t id) {
  Impl& m = *impl_;
  if (!m.requests.count(id)) return false;
  std::vector<int64_t> ids;
  for (const auto& [sid, s] : m.seqs)
    if (s.request == id) ids.push_back(sid);
  for (int64_t sid : ids) {
    Sequence& s = m.seqs.at(sid);
    const int64_t forks = s.pending_forks;
    m.aborted.push_back(m.finish(s, "abort"));
    for (int64_t j = 1; j <= forks; ++j) {  // samples that never forked
      SampleOutput o;
      o.request_id = id;
      o.sample = j;
      o.finish_reason = "abort";
      o.prompt_tokens = m.aborted.back().prompt_tokens;
      m.aborted.push_back(std::move(o));
    }
    erase_id(m.running, sid);
    erase_id(m.waiting, sid);
    if (s.resume_parked >= 0) {
      erase_id(m.resuming, sid);
      m.parked.at(s.resume_parked).claimed = false;
    }
    m.seqs.erase(sid);
  }
  return true;
}

bool Engine::release_session(SessionKey key) {
  Impl& m = *impl_;
  auto it = m.session_ids.find(key);
  if (it == m.session_ids.end()) return false;
  m.drop_parked(it->second, false);
  return true;
}

bool Engine::has_work() const { return !impl_->seqs.empty() || !impl_->aborted.empty() || impl_->in_flight; }

bool Engine::calibrate_if_due() {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  const EngineOptions& o = m.opts;
  if (m.calibrated || o.bench_batch <= 0 || o.bench_prompt <= 0 || o.bench_new_tokens <= 0) return false;
  if (!m.leader() || m.shut_down || has_work() || !m.runner->cache_allocated()) return false;
  m.calibrated = true;
  const int64_t len = std::min(o.bench_prompt + o.bench_new_tokens, max_model_len());
  const int64_t prompt = std::max<int64_t>(1, std::min(o.bench_prompt, len - 1));
  const int64_t fresh = std::max<int64_t>(1, len - prompt);
  const int64_t blocks_each = (len + o.block_size - 1) / o.block_size;
  const int64_t batch = std::max<int64_t>(1, std::min({o.bench_batch, o.limits.max_num_seqs,
                                                       m.kv->num_free() / std::max<int64_t>(1, blocks_each)}));
  const EngineStats before = m.stats;
  int64_t generated_at_cut = -1;  // generated_tokens when the timed run was cut (-1: it was not)
  std::mt19937_64 rng(7);
  // Returns the seconds until the run ended or was cut at bench_max_seconds (the tokens generated
  // by then are counted; what the aborted requests hand back after is not timed).
  auto run = [&](int64_t new_tokens, uint64_t first_id) {
    for (int64_t i = 0; i < batch; ++i) {
      Request r;
      r.id = first_id + static_cast<uint64_t>(i);
      r.prompt.resize(static_cast<size_t>(prompt));
      for (auto& t : r.prompt) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(m.cfg.vocab_size));
      r.params.temperature = 1.0;
      r.params.seed = r.id;
      r.params.max_new_tokens = new_tokens;
      add(std::move(r));
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    double cut = -1;
    while (has_work()) {
      step();
      if (cut < 0 && elapsed() > o.bench_max_seconds) {
        cut = elapsed();
        generated_at_cut = m.stats.generated_tokens;
        for (int64_t i = 0; i < batch; ++i) abort(first_id + static_cast<uint64_t>(i));
      }
    }
    return cut >= 0 ? cut : elapsed();
  };
  // Request ids far from the service's (which count from 1).
  constexpr uint64_t kBenchIds = uint64_t{1} << 62;
  run(4, kBenchIds);  // warm-up: allocator, kernels, this batch's CUDA graph
  generated_at_cut = -1;
  const int64_t generated_before = m.stats.generated_tokens;
  const double seconds = run(fresh, kBenchIds + static_cast<uint64_t>(batch));
  // No stop tokens: batch x fresh, unless the run was cut.
  const int64_t generated = (generated_at_cut >= 0 ? generated_at_cut : m.stats.generated_tokens) - generated_before;
  m.stats = before;
  m.stats.bench_tokens_per_s = static_cast<double>(generated) / std::max(seconds, 1e-9);
  log::info("engine benchmark at the job's shapes ({} requests of {} + {} tokens): {:.0f} tokens/s", batch, prompt,
            fresh, m.stats.bench_tokens_per_s);
  return true;
}

EngineStats Engine::stats() const {
  EngineStats s = impl_->stats;
  s.running = static_cast<int64_t>(impl_->running.size());
  s.waiting = static_cast<int64_t>(impl_->waiting.size() + impl_->resuming.size());
  s.kv_blocks_free = impl_->kv->num_free();
  s.sessions_parked = static_cast<int64_t>(impl_->parked.size());
  s.device_peak_gb = static_cast<double>(compat::peak_allocated_bytes(impl_->device())) / (1024.0 * 1024.0 * 1024.0);
  return s;
}

void Engine::heartbeat() {
  const auto on_stream = impl_->on_stream();
  if (impl_->leader() && !impl_->shut_down) impl_->broadcast(Message::kHeartbeat, {});
}

void Engine::shutdown() {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  if (!m.leader() || m.shut_down) return;
  m.shut_down = true;
  m.broadcast(Message::kShutdown, {});
}

void Engine::follow() {
  Impl& m = *impl_;
  TILLER_CHECK(!m.leader(), "follow() on the TP leader");
  use_device_on_this_thread();
  const auto on_stream = m.on_stream();
  const at::Device where = m.control_device();
  // Messages over the host to a GPU engine: the leader's next step comes within milliseconds
  // while it generates, and the host communicator's wait backs off to 0.5 ms polls; the follower
  // polls without sleeping for a while after each message so that it starts the step at once.
  const bool spin = where.is_cpu() && m.device().is_cuda();
  constexpr double kSpinSeconds = 0.05;
  for (;;) {
    at::Tensor head = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(where));
    dist::WorkPtr next = m.ctl()->broadcast(head, 0);
    if (spin)
      for (const Deadline until = Deadline::after_seconds(kSpinSeconds); !until.expired() && !next->is_completed();)
        std::this_thread::yield();
    next->wait();
    head = head.cpu();
    const auto kind = static_cast<Message>(head[0].item<int64_t>());
    const int64_t words = head[1].item<int64_t>();
    if (kind == Message::kShutdown) return;
    if (kind == Message::kHeartbeat) continue;
    TILLER_CHECK((kind == Message::kStep || kind == Message::kSyncPlan || kind == Message::kSync ||
                  kind == Message::kSleep || kind == Message::kWake) && words > 0,
                 "engine follower: unknown message kind {}", static_cast<int64_t>(kind));
    at::Tensor body = at::empty({words}, at::TensorOptions().dtype(at::kLong).device(where));
    m.ctl()->broadcast(body, 0)->wait();
    body = body.cpu();
    const auto* p = body.data_ptr<int64_t>();
    if (kind == Message::kSyncPlan) {
      // The leader checked the plan against its slices; a follower that still refuses it votes
      // against every sync under it (its error is in this log).
      try {
        if (m.sink) m.sink->install_plan(from_words(p, words));
      } catch (const std::exception& e) {
        log::error("weight sync plan refused on TP rank {}: {}", m.tp->rank(), e.what());
      }
    } else if (kind == Message::kSync) {
      m.receive_weights(static_cast<uint64_t>(p[0]));
    } else if (kind == Message::kSleep) {
      m.sleep_here(static_cast<int>(p[0]));
    } else if (kind == Message::kWake) {
      TILLER_CHECK(words == 2, "engine follower: malformed wake message");
      m.wake_here(p[0] != 0, p[1] != 0);
    } else {
      // The watchdog's tests: a follower that stops answering its leader mid-generation.
      if (dist::fault_hang_requested("engine_step")) dist::hang_here("engine_step");
      m.runner->run(StepBatch::decode(std::vector<int64_t>(p, p + words)), /*sample=*/false);
    }
  }
}

}  // namespace tiller::engine
