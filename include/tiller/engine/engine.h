// The inference engine: continuous batching over a paged KV cache.
//
// An Engine owns one model replica (or, with tensor parallelism, this rank's shard of it), the KV
// cache, the block manager and the queues. Each step() asks the scheduler which sequences run
// (decodes first, chunked prefill, preemption by recomputation), runs one packed forward over
// all of them, samples every sequence whose tokens are all computed, and returns the samples that
// finished. A request with n samples is prefilled once: its n samples then fork the prompt's KV
// blocks (copy-on-write) and decode independently.
//
// Asynchronous scheduling (without tensor parallelism): while a decode step runs on the device,
// step() launches the next one before it waits for this one's draws. The next step reads the
// pending tokens on the device, so the host's work between steps (taking the draws, stop checks,
// scheduling, staging inputs) overlaps the GPU's. The host cannot see a stop token before it
// launches the next step: such a sample computes one extra row there, which is dropped. Steps
// that prefill, fork samples, preempt or admit are launched only after the host has seen the
// draws before them, exactly as without it. Outputs are the same either way.
//
// Multi-turn sessions: a request with keep_session parks each finished sample's KV cache (its
// blocks stay allocated) under SessionKey{request, sample}. A later request that names it in
// `resume` (its prompt: the session's tokens, then the next turn's, e.g. a tool's observation)
// starts from the cached prefix and prefills only the new tokens. Parked sessions hold blocks
// without running: they are evicted, oldest first, when running or waiting sequences need the
// blocks (scheduler.h), when they wait longer than session_timeout_s, past max_sessions, and on
// a weight update or sleep (their keys and values are of the old weights). A resume that finds its
// session gone, or whose prompt does not start with the session's tokens, is served as a plain
// request from its prompt (counted in session_misses); outputs are the same either way.
//
// Tensor parallelism: every rank of the TP group builds an Engine over the same group. Rank 0
// (the leader) takes requests and runs step(); it broadcasts each step's batch to the others,
// which run follow() until the leader calls shutdown(). All ranks run the same forward; the
// row-parallel outputs are all-reduced through the communicator.
//
// Threading: not thread-safe; one thread drives an Engine (the gRPC service runs it on its loop
// thread). Errors: an invalid request throws InvalidRequest from add() and changes nothing;
// anything else that throws leaves the engine unusable.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tiller/core/error.h"
#include "tiller/engine/scheduler.h"
#include "tiller/engine/weight_sink.h"
#include "tiller/model/model_config.h"
#include "tiller/model/sampling_params.h"

namespace at {
class Tensor;
}
namespace tiller::dist {
class Communicator;
}
namespace tiller::model {
struct ModelWeights;  // tiller/model/weights.h
}

namespace tiller::engine {

// A request the engine refuses (bad token id, lengths over the limits, bad sampling parameters):
// the message names the field and the limit. The gRPC service answers INVALID_ARGUMENT.
class InvalidRequest : public Error {
 public:
  using Error::Error;
};

// The longest sequence an engine holds: a prompt and a completion of rollout's largest sizes.
inline constexpr int64_t kMaxModelLen = int64_t{1} << 25;

struct EngineOptions {
  std::string device = "cpu";   // "cpu" or "cuda:N"; the weights must be there (their dtype is the engine's)
  int64_t block_size = 16;      // tokens per KV block
  // KV cache size: num_blocks when > 0, else kv_cache_gb when > 0, else (CUDA) this fraction of
  // the memory free after the weights are loaded, or (CPU) 1 GiB.
  int64_t num_blocks = 0;
  double kv_cache_gb = 0;
  double gpu_memory_fraction = 0.85;
  int64_t max_model_len = 0;    // prompt + new tokens (<= kMaxModelLen); 0: the config's max_position_embeddings
  // Decode steps on CUDA without tensor parallelism replay CUDA graphs, one per batch-size bucket
  // up to max_graph_batch (0: max_num_seqs, at most 512), captured on first use.
  bool cuda_graphs = true;
  int64_t max_graph_batch = 0;
  bool async_scheduling = true;  // see above; ignored with tensor parallelism
  // Decode steps apply RoPE inside the paged attention kernel where it serves the shape (bf16/fp16,
  // head size 64 or 128, query-head groups of 2 to 16): no RoPE launch per layer. Off: a separate
  // RoPE kernel, as prefill does (for comparisons).
  bool rope_in_attention = true;
  // Decode attention runs a sequence's KV head on one warp instead of four while its keys (per KV
  // split) number at most this (short contexts), in batches whose four-warp grid would take more
  // than two waves of the GPU (model/cuda/paged_attention.h paged_decode_pack_keys); 0: always four
  // (for comparisons). At most 1 << 20. Off in algo.logprob_match = bitwise.
  int64_t decode_pack_keys = 512;
  // With fp8_scaling "tensor": the norms and SwiGLU quantize their output rows in the same kernel
  // and the kernels that read each FP8 GEMM's output apply its rows' scales (no quantization
  // launches of their own; model/transformer.h BlockContext::fp8_fused). Off: one FP8 linear at a
  // time, with the same numerics (for comparisons).
  bool fp8_fused = true;
  // "fp8": the linear layers' weights are also held in 128x128 blocks of e4m3, quantized at load
  // and again after every weight sync, and their GEMMs run in FP8 (Hopper's tensor cores; emulated
  // elsewhere) with activations quantized per token and group of 128 (docs/engine.md, "FP8
  // engines"). "none": the weights' dtype throughout.
  std::string quantization = "none";
  // The FP8 engine's scales: "block" (128x128 weight blocks, activation groups of 128),
  // "channel" (one per weight row and per token) or "tensor" (one per weight and one per token,
  // the fastest: fp8_fused below). Block's finer scales keep the engine nearer the trainer
  // (docs/engine.md, docs/benchmarks.md).
  std::string fp8_scaling = "block";
  // "fp8": the KV cache holds e4m3 codes with one fp32 scale per (token, KV head) row, about half
  // the bytes of bf16, and attention reads them dequantized (docs/engine.md, "FP8 KV cache").
  // "auto": the weights' dtype.
  std::string kv_cache_dtype = "auto";
  // Start asleep at level 1: the KV cache is allocated by the first wake() (the hybrid engine,
  // whose trainer may still hold the memory when the engine is built).
  bool start_asleep = false;
  // Routing replay (algo.routing_replay): each sample's experts per token (SampleOutput::routes).
  // Mixture-of-experts models only; at most 32767 experts (int16).
  bool record_routes = false;
  // CUDA: the engine's kernels run on a stream of its own (each call that launches work makes it
  // current for its duration, whichever thread calls), not the calling thread's. For a TP engine
  // inside a trainer's process (the hybrid engine): the trainer's collectives and the engine's on
  // one shared stream would queue behind each other in a different order on each rank, and wait
  // on each other across ranks.
  bool own_stream = false;
  // Multi-turn sessions (above): how long a parked session waits for its next turn, and how many
  // may be parked (0: 4 x max_num_seqs).
  double session_timeout_s = 300;
  int64_t max_sessions = 0;
  SchedulerLimits limits;
  // The engine's benchmark at its job's shapes (logging.efficiency; calibrate_if_due()): this many
  // requests of bench_prompt random tokens, bench_new_tokens sampled each. 0: none. The timed
  // run stops at bench_max_seconds (its requests aborted; the rate is of what ran), so the
  // calibration fits inside the call that triggers it (a hybrid engine's wake).
  int64_t bench_batch = 0, bench_prompt = 0, bench_new_tokens = 0;
  double bench_max_seconds = 20;
};

// What an engine rank holds on its device (the hybrid engine's phases report it).
struct EngineMemory {
  int64_t weight_bytes = 0;    // 0 while asleep at level 2
  int64_t kv_cache_bytes = 0;  // 0 while asleep
  int sleep_level = 0;         // 0 awake, 1 no KV cache, 2 no KV cache and no weights
  // The process's device memory (its CUDA caching allocator; zeros on CPU).
  int64_t device_allocated = 0, device_reserved = 0;
};

// A parked session: sample `sample` of request `request`.
struct SessionKey {
  uint64_t request = 0;
  int64_t sample = 0;
  bool operator<(const SessionKey& o) const { return request != o.request ? request < o.request : sample < o.sample; }
  bool operator==(const SessionKey& o) const { return request == o.request && sample == o.sample; }
};

struct Request {
  uint64_t id = 0;                 // unique among the engine's live requests
  std::vector<int64_t> prompt;
  model::SamplingParams params;    // sample j draws with params.seed + j
  int64_t n = 1;                   // samples of this prompt
  bool keep_session = false;       // park each finished sample's KV cache (stop or length)
  bool resume = false;             // start from the parked session `session` (n must be 1)
  SessionKey session;
  // step() also returns each unfinished sample's newly drawn token (a SampleOutput with an empty
  // finish_reason, its tokens and log-probs only the new ones); the finished sample still comes
  // back whole.
  bool stream = false;
};

struct SampleOutput {
  uint64_t request_id = 0;
  int64_t sample = 0;              // 0 .. n-1
  std::vector<int64_t> tokens;     // generated ids; the stop token included when one ended it
  std::vector<float> logprobs;     // one per generated token (see sampling.h)
  std::string finish_reason;       // "stop", "length" or "abort"; "" for a streamed partial (Request::stream)
  int64_t prompt_tokens = 0;
  int64_t preemptions = 0;         // times this sample was preempted and recomputed
  // The weight version that sampled each token, run-length coded: tokens [version_starts[i],
  // version_starts[i + 1]) (the last run to the end) came from weights versions[i]. One run unless
  // the sample spanned a weight update (see weights_updated()). Empty when no token was generated.
  std::vector<int64_t> version_starts;
  std::vector<uint64_t> versions;
  // EngineOptions::record_routes with a mixture of experts: the experts that routed every token
  // the engine computed (the prompt and every generated token but the last), [prompt_tokens +
  // tokens.size() - 1, route_width], route_width = sparse layers x experts per token (each layer's
  // top-k in router order). Empty otherwise.
  std::vector<int16_t> routes;
  int64_t route_width = 0;
};

struct EngineStats {
  int64_t running = 0, waiting = 0;           // sequences
  int64_t kv_blocks_total = 0, kv_blocks_free = 0;
  int64_t steps = 0;
  int64_t prompt_tokens = 0;     // prompts prefilled (each once, however often recomputed)
  int64_t generated_tokens = 0, preemptions = 0;
  int64_t last_step_prefill_tokens = 0;  // tokens of the latest step that were not decodes
  int64_t requests_finished = 0;
  int64_t launched_ahead = 0;  // steps launched before the host saw the step before (async scheduling)
  int64_t kv_rebuilds = 0;     // live sequences whose KV cache was recomputed after a weight update
  int64_t prefill_tokens = 0;  // tokens computed in prefill chunks (prompts, recomputations, new turns)
  int64_t sessions_parked = 0;         // now
  int64_t session_resumes = 0;         // requests that started from a parked session's cache
  int64_t session_tokens_reused = 0;   // cached tokens those requests did not compute again
  int64_t session_misses = 0;          // resumes that found nothing to reuse
  int64_t session_evictions = 0;       // parked sessions dropped (memory, timeout, limit, weights, sleep)
  double seconds_in_steps = 0;                // wall time inside step()
  double bench_tokens_per_s = 0;  // calibrate_if_due()'s result (0: not measured)
  // The most this process's device allocator has held on the engine's GPU (this rank's: the
  // leader's, for a TP engine) since it started, or since the last hybrid phase change; 0 on CPU.
  double device_peak_gb = 0;
};

class Engine {
 public:
  // Takes the model's weights (this rank's TP shard of them when `tp` has more than one rank;
  // see engine_weights.h) on the options' device. `tp` may be null (no tensor parallelism)
  // and must outlive the engine. `control`, when given, is the same TP group over the host (MPI):
  // the leader's messages to its followers (steps, syncs, sleep, wake, heartbeats) and the
  // group's votes go over it, so a follower waits for the next message on the host instead of in
  // a collective pending on its GPU; the forward's collectives stay on `tp`.
  Engine(const model::ModelConfig& cfg, model::ModelWeights weights, const EngineOptions& opts,
         dist::Communicator* tp = nullptr, dist::Communicator* control = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const model::ModelConfig& config() const;
  const EngineOptions& options() const;
  int64_t max_model_len() const;
  // How decode steps run here: the paged decode kernel (CUDA), replayed from CUDA graphs.
  bool paged_decode() const;
  bool cuda_graphs() const;
  int tp_size() const;
  int tp_rank() const;

  // Leader only. Validates and queues a request; throws InvalidRequest (nothing queued).
  void add(Request r);
  // Leader only. Drops a live request: its unfinished samples come back from the next step()
  // with finish_reason "abort". False when no live request has the id.
  bool abort(uint64_t id);
  // Leader only. Frees a parked session's KV cache (the episode ended). False when none is parked
  // under the key.
  bool release_session(SessionKey key);
  // Leader only. Runs one step if there is work; returns the samples that finished in it (and, for
  // Request::stream, each unfinished sample's new token as a partial output). With
  // asynchronous scheduling the step it returns may have been launched by the call before, and
  // the next step may already be on the device when it returns.
  std::vector<SampleOutput> step();
  // Leader only. Completes the step still on the device (asynchronous scheduling), launching
  // nothing, and returns what finished in it and the aborted samples: afterwards no step is in
  // flight and the weights may change (the service calls it before a weight update).
  std::vector<SampleOutput> drain();
  bool has_work() const;
  EngineStats stats() const;
  // Leader, idle and awake: once, the engine's own benchmark at the options' bench_* shapes, as
  // `tiller bench generate` runs it (a short warm-up, then bench_batch requests of random
  // prompts, temperature 1, no stop token), recorded in stats().bench_tokens_per_s: generated
  // tokens over the run's seconds, prefill included. The batch is capped by what the KV cache
  // holds at full length, the timed run by bench_max_seconds; the other counters are left as they
  // were. Returns whether it ran.
  bool calibrate_if_due();

  // Leader, TP > 1: tells the followers the leader is alive while there is no work (they give up
  // after the communicator's timeout without a message). No-op without TP.
  void heartbeat();
  // Leader: ends follow() on every other rank. Called by the destructor if not before.
  void shutdown();
  // Followers: runs the leader's steps (and weight syncs) until shutdown(). Throws TimeoutError
  // when the leader is silent for longer than the communicator's timeout.
  void follow();
  bool is_leader() const;
  // Makes the engine's device the calling thread's current one (a CUDA engine on cuda:N): for a
  // thread the engine did not start that will run its steps (the service's loop), so that what
  // allocates or launches on "the current device" lands on the engine's.
  void use_device_on_this_thread() const;

  // --- Weight updates in place (the weight sync, sync/weight_sync.h) ---
  // This rank's weights by HF name (its TP slices; a tied LM head is the embedding and not
  // listed): views of the engine's own storage, so writes change what the next step computes.
  // Write only between steps (after drain()).
  std::map<std::string, at::Tensor> parameters() const;
  // Every TP rank, before serving or following: where syncs deliver. Must outlive the engine.
  void set_weight_sink(WeightSink* sink);
  WeightSink* weight_sink() const;  // null until set
  // Leader: checks a serialized bucket plan against this rank's weights, then installs it on
  // every TP rank; returns its id. Throws InvalidRequest naming what does not fit.
  uint64_t install_sync_plan(const std::string& plan);
  // Leader, with no step in flight (drain() first): every TP rank receives one sync to `version`
  // through its sink; returns the TP group's outcome (complete only when every rank completed).
  // A sync that fails after writing leaves the weights incomplete: add() then refuses every
  // request (InvalidRequest, naming the failed sync) until a sync completes.
  WeightSink::Result receive_weights(uint64_t version);
  // Why the weights cannot be served (a sync failed part way), or "".
  const std::string& weights_broken() const;
  // Leader, with no step in flight (drain() first), after the weights changed to `version` (a sync
  // completed, or they were replaced out of band): tokens sampled from now on are recorded as of
  // `version`, and every live sequence keeps its tokens and their log-probs (each from the
  // weights that sampled it) but drops its KV cache, which the next steps recompute with the new
  // weights before it continues (counted in EngineStats::kv_rebuilds). This is what lets a sample
  // span a weight sync (partial rollouts) without attending to keys and values of older weights.
  void weights_updated(uint64_t version);
  // Every TP rank, with no step in flight, after its weights were written out of band (not by a
  // sync, which does this itself): an FP8 engine quantizes them again into its FP8 copies, in
  // place. No-op without EngineOptions::quantization fp8. Returns the seconds it took (the
  // device's work included).
  double requantize();
  uint64_t weight_version() const;

  // --- Sleep and wake (the hybrid engine; docs/sync.md) ---
  // Leader, with no live sequence (else InvalidRequest): every TP rank frees its KV cache and
  // decode graphs (level 1), and its weights too (level 2: add() then refuses requests until a
  // weight sync completes). Nothing in flight; the block manager keeps its size, so the cache
  // comes back with the same number of blocks.
  void sleep(int level);
  // Leader: every TP rank allocates what sleep() freed, the weights first (`weights`: their
  // memory, for the sync that refills them), then (`cache`) the KV cache; add() refuses requests
  // while the cache is asleep. Wake only what the next phase needs: the weights before a sync,
  // the cache once the trainers have freed their memory.
  void wake(bool weights, bool cache);
  int sleep_level() const;
  // How many times this rank's weights were dropped (level 2) so far: a handoff that refills them
  // compares it with the count when it last did (any thread).
  uint64_t weight_drops() const;
  EngineMemory memory() const;  // this rank's

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::engine
