// tiller bench train: ZeRO-3 training throughput of a preset shape, one rank per GPU under
// mpirun. Each step is a forward and backward of --micro-batch sequences of --seq random tokens
// per rank (the loss is the mean token log-prob; --accumulate N: N of them, their gradients
// summed, as a job whose train batch is N micro-batches per rank), then clipping and AdamW (with
// --sequence-parallel S, per group of S ranks, each holding 1/S of the tokens): the same work as
// ../shared/bench/peer_bench.py fsdp, which scripts/gpu/bench_train.sh runs beside it.
//
// Reported from the slowest rank, median over the timed steps: seconds per step, tokens/s/GPU,
// MFU with the peer's formula (6 x non-embedding-head parameters + causal attention, against
// 989 TFLOP/s), peak memory, and where the step's time goes: optimizer; exposed communication
// (GPU time compute stood waiting for a gather or reduce-scatter, from CUDA events); the rest is
// compute, of which recomputation is estimated as the recomputed forward's share of the FLOPs.
// --recompute picks what the backward recomputes (train.recompute), --compute-shard whether a bf16
// copy of the shards is kept (train.compute_shard), --optimizer-offload cpu runs AdamW on the host
// (roles.<r>.optimizer_offload); `auto` as tiller train chooses, through the same memory plan,
// which also refuses a job that cannot fit the GPU before anything is allocated.
// --score times the actor's scoring pass instead (what a trainer rank does for each scoring
// request): the sharded forward without autograd, the log-probs and entropies of every token,
// copied to the host; compare it with `tiller bench forward` on the same shape. --frozen scores
// with a frozen model (the reference's and reward's: no master or optimizer state), which lets a
// 7B model be timed on one GPU. --fp8 times the same steps again with FP8 training's GEMMs
// (roles.<r>.fp8) and reports them beside the bf16 ones, with the speedup.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "model/torch_compat.h"
#include "step_profiler.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/communicator.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/dist/watchdog.h"
#include "tiller/job/memory_plan.h"
#include "tiller/model/fp8.h"
#include "tiller/model/storage_swap.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::cli {
namespace {

struct TrainBenchOptions {
  std::string model = "qwen2-1.5b";
  std::string logprob_match = "off";
  std::string experts = "auto";
  int64_t seq = 2048;
  int64_t micro_batch = 4;
  int accumulate = 1;  // micro-batches per optimizer step
  int sequence_parallel = 1;  // ranks sharing each micro-batch (Ulysses)
  int context_parallel = 1;   // of those, groups that all-gather keys instead of splitting heads
  int steps = 6;  // the first two are warm-up, as in the peer
  std::string backend = "auto";
  double timeout_s = 300;
  int64_t chunk_rows = 2048;
  std::string out;
  std::string profile;  // Chrome trace of rank 0's last step
  std::string recompute = "auto";  // train.recompute's choices
  int64_t recompute_layers = -1;      // train.recompute_layers's
  std::string compute_shard = "auto";  // train.compute_shard's
  std::string expandable_segments = "auto";  // cluster.expandable_segments's
  std::string optimizer_offload = "none";  // roles.<r>.optimizer_offload's
  int optimizer_threads = 0;
  double gpu_memory_gb = 0;  // the plan's GPU size; 0: the device's
  std::string reduce_dtype = "fp32";
  bool score = false;  // time the scoring forward instead of training steps
  bool frozen = false; // with score: a frozen model (the reference and reward roles)
  bool fp8 = false;     // the same steps again with FP8 training's GEMMs (roles.<r>.fp8)
  std::string fp8_scaling = "block";
  std::string fp8_accumulation = "fast";  // roles.<r>.fp8_fast_accumulation
};

// A flag's value as the config's enum (the flags take the config keys' spellings).
template <typename E>
E choice(const std::string& value, const char* flag) {
  if (const auto e = parse_enum<E>(value)) return *e;
  throw ConfigError(fmt::format("{} {}: not one of its choices", flag, value));
}

// The memory plan of this job (job/memory_plan.h, as tiller train plans a trained role):
// recompute and compute_shard resolved, and a refusal naming the rank when it cannot fit.
job::MemoryPlan plan_job(const TrainBenchOptions& o, const model::ModelConfig& cfg, const at::Device& dev,
                             int world, int rank, int64_t tokens_per_rank) {
  JobConfig job;
  // The compute dtype of the run, or of the GPU run being planned.
  job.roles.actor.dtype = dev.is_cuda() || o.gpu_memory_gb > 0 ? Precision::kBf16 : Precision::kFp32;
  job.roles.actor.optimizer_offload = choice<OptimizerOffload>(o.optimizer_offload, "--optimizer-offload");
  job.train.recompute = choice<RecomputeChoice>(o.recompute, "--recompute");
  job.train.recompute_layers = o.recompute_layers;
  job.train.compute_shard = choice<ComputeShard>(o.compute_shard, "--compute-shard");
  job.cluster.expandable_segments = choice<ExpandableSegments>(o.expandable_segments, "--expandable-segments");
  job.roles.actor.sequence_parallel = o.sequence_parallel;  // the allocator's choice looks at it
  job.train.reduce_dtype = choice<Precision>(o.reduce_dtype, "--reduce-dtype");
  job.roles.actor.fp8 = o.fp8;  // its GEMM operands: the plan covers the larger of the two runs
  // --gpu-memory-gb plans for that GPU (on the CPU too: to check a job before renting GPUs).
  int64_t gpu = static_cast<int64_t>(o.gpu_memory_gb * double(int64_t{1} << 30));
  if (gpu == 0 && dev.is_cuda()) gpu = model::device_memory(dev).total;
  job::MemoryPlan plan = job::plan_trainer(job, cfg, o.frozen ? 1 : world, tokens_per_rank, gpu);
  if (!o.score) {
    // What to change: the flags not already at their least memory.
    std::string knobs = "lower --micro-batch or --seq, run on more ranks";
    if (plan.recompute != zero::Recompute::kBlocks) knobs += ", pass --recompute blocks";
    if (plan.keep_compute_shard && o.optimizer_offload != "cpu") knobs += ", pass --compute-shard cast";
    if (o.optimizer_offload != "cpu") knobs += ", or move the optimizer to the host (--optimizer-offload cpu)";
    job::check_trainer_fits(plan, rank, "bench train, " + o.model, knobs);
  }
  return plan;
}

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int train_bench(const TrainBenchOptions& o, dist::MpiEnv& env);

int run_train_bench(const TrainBenchOptions& o, int* argc, char*** argv) {
  apply_logprob_match(o.logprob_match);
  apply_expert_kernels(o.experts);
  dist::MpiEnv env(argc, argv);
  log::init(env.rank(), "bench", log::Level::kWarn);
  // A rank that fails (its GPU's memory, a collective's deadline) ends the job at once, every rank
  // saying where it was (dist/watchdog.h): unwound instead, its communicators' teardown would wait
  // for the peers stuck in a collective with it, silently, until their deadline.
  dist::Watchdog::start(env.rank(), fmt::format("bench train, rank {} of {}", env.rank(), env.size()));
  try {
    return train_bench(o, env);
  } catch (const std::exception& e) {
    if (env.size() > 1) dist::MpiEnv::fail_job(env.rank(), e);
    throw;
  }
}

int train_bench(const TrainBenchOptions& o, dist::MpiEnv& env) {
  if (o.steps < 3) throw ConfigError("--steps: at least 3 (two warm-up steps are not timed)");
  if (o.frozen && !o.score) throw ConfigError("--frozen times a scoring pass: add --score");
  if (o.score && o.accumulate != 1) throw ConfigError("--accumulate counts training micro-batches: drop it with --score");
  RankComm bc = open_rank_comm(env, o.backend, o.timeout_s, "bench.train");
  dist::Communicator& comm = bc.comm();
  const at::Device dev = bc.device;
  // --gpu-memory-gb on a larger card: allocate no more than that, as that card would.
  if (o.gpu_memory_gb > 0) model::cap_device_memory(dev, static_cast<int64_t>(o.gpu_memory_gb * double(int64_t{1} << 30)));

  const model::ModelConfig cfg = model::preset(o.model);
  zero::ShardedModelOptions mo;
  mo.compute_dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  mo.device = dev;
  mo.max_grad_norm = 1.0;
  mo.logprob_chunk_rows = o.chunk_rows;
  mo.measure_waits = true;
  mo.reduce_dtype = o.reduce_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  mo.trainable = !o.frozen;
  mo.optimizer_on_host = o.optimizer_offload == "cpu" && !o.frozen;
  mo.optimizer_threads = o.optimizer_threads;
  const int sp = o.sequence_parallel;
  // The plan before any allocation; every rank takes the least-memory choice of any (GPUs of
  // different sizes; one mode per sequence group).
  job::MemoryPlan plan = plan_job(o, cfg, dev, comm.size(), comm.rank(), o.seq * o.micro_batch / sp);
  at::Tensor choice = at::tensor({job::recompute_order(plan.recompute, plan.recompute_layers),
                                  plan.keep_compute_shard ? 1.0 : 0.0, plan.expandable_segments ? 0.0 : 1.0},
                                 at::kDouble);
  bc.world->all_reduce(choice, dist::ReduceOp::kMin)->wait();
  const auto [recompute, recompute_layers] = job::recompute_from_order(choice[0].item<double>());
  mo.recompute = recompute;
  mo.recompute_layers = recompute_layers;
  mo.keep_compute_shard = choice[1].item<double>() > 0.5;
  // The caching allocator as tiller train sets it (cluster.expandable_segments), before the model loads.
  const bool expandable = dev.is_cuda() && model::set_expandable_segments(choice[2].item<double>() < 0.5);
  zero::ShardedModel model(cfg, comm, mo);
  if (comm.size() % sp != 0)
    throw ConfigError(fmt::format("--sequence-parallel {} must divide the {} ranks", sp, comm.size()));
  if (o.seq * o.micro_batch < sp)
    throw ConfigError(fmt::format("--sequence-parallel {}: a group's {} tokens leave some ranks nothing to time; "
                                  "raise --seq or --micro-batch", sp, o.seq * o.micro_batch));
  std::unique_ptr<dist::Communicator> seq_group;
  if (sp > 1) {
    zero::check_sequence_parallel(cfg, sp, "--sequence-parallel", o.context_parallel);
    seq_group = comm.split(comm.rank() / sp, comm.rank(), "bench.sequence");
    model.set_sequence_group(*seq_group, o.context_parallel);
  }
  {
    const model::NamedTensors init = model::init_weights(cfg, model::Head::kLm, 1, mo.compute_dtype, dev);
    model.load(init, o.model);
  }

  std::vector<std::vector<int64_t>> seqs;
  // A sequence group shares its data: the same sequences on each of its ranks, which keep their slice.
  at::Generator gen = at::detail::createCPUGenerator(100 + comm.rank() / sp);
  for (int64_t i = 0; i < o.micro_batch; ++i) {
    at::Tensor t = at::randint(0, cfg.vocab_size, {o.seq}, gen, at::kLong);
    seqs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + o.seq);
  }
  const model::PackedBatch batch = model::PackedBatch::pack(seqs, dev);
  const zero::SequenceSlice slice = zero::SequenceSlice::of(batch, sp, comm.rank() % sp);
  const at::Tensor targets = batch.tokens.roll(-1).narrow(0, slice.first_row, slice.tokens.numel());

  // The timed steps (scoring or training), the slowest rank's medians: step, forward+backward,
  // optimizer, exposed communication, peak memory, host update, host copy wait.
  auto timed = [&]() {
    std::vector<double> step_s, fwd_bwd_s, opt_s, wait_s, host_update_s, host_copy_wait_s;
    compat::reset_peak(dev);
    for (int s = 0; s < o.steps && o.score; ++s) {
      dist::Watchdog::set_phase(fmt::format("scoring step {} of {}", s + 1, o.steps));
      compat::synchronize(dev);
      StepProfiler profiler(!o.profile.empty() && s == o.steps - 1 && comm.rank() == 0);
      const auto t0 = Clock::now();
      {
        c10::AutoGradMode no_grad(false);
        at::Tensor entropy;
        const at::Tensor lp = model.token_logprobs(slice, targets, 1.0, &entropy);
        // As the role worker answers: both to the host, fp32 (the copy waits for the GPU).
        const at::Tensor host_lp = lp.to(at::kCPU, at::kFloat), host_ent = entropy.to(at::kCPU, at::kFloat);
      }
      const double total = since(t0);
      profiler.save(o.profile);
      const double waited = model.take_wait_seconds();
      if (s < 2) continue;
      step_s.push_back(total);
      fwd_bwd_s.push_back(total);
      opt_s.push_back(0);
      wait_s.push_back(waited);
    }
    for (int s = 0; s < o.steps && !o.score; ++s) {
      dist::Watchdog::set_phase(fmt::format("training step {} of {}", s + 1, o.steps));
      compat::synchronize(dev);
      StepProfiler profiler(!o.profile.empty() && s == o.steps - 1 && comm.rank() == 0);
      const auto t0 = Clock::now();
      // The gradients of --accumulate micro-batches add up (each reduce-scattered as its backward
      // ends, as tiller train does), then one optimizer step.
      for (int a = 0; a < o.accumulate; ++a)
        model.token_logprobs(slice, targets).mean().neg().div(static_cast<double>(o.accumulate)).backward();
      compat::synchronize(dev);
      const double fb = since(t0);
      const auto t1 = Clock::now();
      model.step(1e-5);
      compat::synchronize(dev);
      const double opt = since(t1), total = since(t0);
      profiler.save(o.profile);
      const double waited = model.take_wait_seconds();
      if (s < 2) continue;
      step_s.push_back(total);
      fwd_bwd_s.push_back(fb);
      opt_s.push_back(opt);
      wait_s.push_back(waited);
      if (const zero::HostAdamW* h = model.host_optimizer()) {
        host_update_s.push_back(h->last_timing().update_s);
        host_copy_wait_s.push_back(h->last_timing().copy_wait_s);
      }
    }
    // The slowest rank's medians.
    auto med = [](const std::vector<double>& v) { return v.empty() ? 0.0 : median(v); };
    at::Tensor t = at::tensor({med(step_s), med(fwd_bwd_s), med(opt_s), med(wait_s),
                               static_cast<double>(compat::peak_allocated_bytes(dev)), med(host_update_s),
                               med(host_copy_wait_s)},
                              at::kDouble);
    bc.world->all_reduce(t, dist::ReduceOp::kMax)->wait();
    return t;
  };
  const at::Tensor t = timed();
  // --fp8: the same steps again with FP8 training's GEMMs, on the weights the first run left.
  at::Tensor t8;
  if (o.fp8) {
    model.set_fp8(model::fp8::parse_scaling(o.fp8_scaling, "--fp8-scaling"), o.fp8_accumulation == "fast");
    t8 = timed();
  }
  const double step = t[0].item<double>(), fb = t[1].item<double>(), opt = t[2].item<double>(),
               waited = t[3].item<double>(), peak = t[4].item<double>();
  // The plan's estimate of this rank's peak, to hold against the measured one.
  const double planned = static_cast<double>(plan.ranks.front().peak());

  const int64_t tokens = o.seq * o.micro_batch * o.accumulate / sp;  // per GPU per step
  // A mixture of experts multiplies by the experts each token routes to (active parameters).
  const int64_t nparam = model::active_parameters(cfg);
  const int64_t emb = cfg.vocab_size * cfg.hidden_size;
  const double flops_tok = 6.0 * static_cast<double>(nparam - (cfg.tie_word_embeddings ? 0 : emb)) +
                           6.0 * cfg.num_layers * cfg.hidden_size * o.seq;
  const double tok_s = tokens / step;
  // Recomputation: one more forward of the blocks (2 x block parameters per token + attention),
  // out of forward + recompute + backward of blocks plus the head's 4 passes.
  const double block_params = static_cast<double>(nparam - emb - cfg.hidden_size);
  const double block_fwd = 2.0 * block_params + 2.0 * cfg.num_layers * cfg.hidden_size * o.seq;
  const double head_flops = 2.0 * static_cast<double>(emb) * 4;
  const double compute = std::max(0.0, fb - waited);
  // --fp8's run beside: its step, rate and memory, and its speedup over the bf16 steps above.
  auto fp8_json = [&](double flops_per_token, const char* rate_key) {
    const double s8 = t8[0].item<double>();
    nlohmann::ordered_json f;
    f["scaling"] = o.fp8_scaling;
    // Fast only where tensor scaling runs on tensor cores (the emulation accumulates in fp32).
    f["forward_accumulation"] =
        o.fp8_scaling == "tensor" && model::fp8::tensor_cores(dev) ? o.fp8_accumulation : std::string("fp32");
    f["step_s"] = s8;
    f["tokens_per_s_per_gpu"] = tokens / s8;
    f[rate_key] = flops_per_token * tokens / s8 / (std::string(rate_key) == "tflops" ? 1e12 : 989e12);
    f["forward_backward_s"] = t8[1].item<double>();
    f["optimizer_s"] = t8[2].item<double>();
    f["exposed_comm_s"] = t8[3].item<double>();
    f["peak_mem_GiB"] = t8[4].item<double>() / double(1 << 30);
    f["speedup"] = step / s8;
    return f;
  };
  nlohmann::ordered_json r;
  if (o.score) {
    // Forward FLOPs as `tiller bench forward` counts them: 2 x matmul parameters (the head's
    // included, the embedding's not) + causal attention, per token.
    int64_t matmul_params = nparam - emb;
    if (cfg.tie_word_embeddings) matmul_params += emb;
    const double fwd_tok = 2.0 * static_cast<double>(matmul_params) + 2.0 * 2.0 * (o.seq / 2.0) * cfg.q_size() * cfg.num_layers;
    r["bench"] = "score";
    r["logprob_match"] = o.logprob_match;
    if (cfg.moe()) r["experts"] = o.experts;
    r["model"] = o.model;
    r["world"] = comm.size();
    r["backend"] = comm.backend();
    r["trainable"] = model.options().trainable;
    r["seq"] = o.seq;
    r["mbs"] = o.micro_batch;
    r["sequence_parallel"] = sp;
    r["context_parallel"] = o.context_parallel;
    r["tokens_per_gpu_per_step"] = tokens;
    r["steps_timed"] = o.steps - 2;
    r["step_s"] = step;
    r["tokens_per_s_per_gpu"] = tok_s;
    r["tflops"] = fwd_tok * tok_s / 1e12;
    r["exposed_comm_s"] = waited;
    r["peak_mem_GiB"] = peak / double(1 << 30);
    if (o.fp8) r["fp8"] = fp8_json(fwd_tok, "tflops");
    if (env.rank() == 0) emit_json(r.dump(), o.out);
    return 0;
  }
  const zero::ShardMemory held = model.memory();
  r["bench"] = "train";
  r["logprob_match"] = o.logprob_match;
  if (cfg.moe()) r["experts"] = o.experts;
  r["model"] = o.model;
  r["params_B"] = model::num_parameters(cfg) / 1e9;
  if (cfg.moe()) r["active_params_B"] = nparam / 1e9;
  r["world"] = comm.size();
  r["backend"] = comm.backend();
  r["seq"] = o.seq;
  r["mbs"] = o.micro_batch;
  r["accumulate"] = o.accumulate;
  r["sequence_parallel"] = sp;
  r["context_parallel"] = o.context_parallel;
  r["recompute"] = zero::recompute_name(recompute);
  r["recompute_layers"] = mo.recompute_layers;
  r["compute_shard"] = mo.keep_compute_shard ? "keep" : "cast";
  r["optimizer_offload"] = o.optimizer_offload;
  r["reduce_dtype"] = o.reduce_dtype;
  r["expandable_segments"] = expandable;
  r["expandable_segments_reason"] = plan.allocator_reason;
  r["tokens_per_gpu_per_step"] = tokens;
  r["steps_timed"] = o.steps - 2;
  r["step_s"] = step;
  r["tokens_per_s_per_gpu"] = tok_s;
  r["mfu_vs_989"] = flops_tok * tok_s / 989e12;
  r["peak_mem_GiB"] = peak / double(1 << 30);
  r["planned_peak_GiB"] = planned / double(1 << 30);
  r["plan_error"] = peak > 0 ? planned / peak - 1.0 : 0.0;  // estimate against measured, this rank's world max
  r["host_optimizer_GiB"] = static_cast<double>(held.host) / double(1 << 30);
  nlohmann::ordered_json b;
  b["forward_backward_s"] = fb;
  b["exposed_comm_s"] = waited;
  b["compute_s"] = compute;
  // What the backward recomputes: whole blocks, the attention half, or nothing.
  const double attn_params = static_cast<double>(cfg.num_layers) *
                             (cfg.hidden_size * (cfg.q_size() + 2 * cfg.kv_size()) + cfg.q_size() * cfg.hidden_size);
  const double mode_redone = recompute == zero::Recompute::kBlocks          ? block_fwd
                             : recompute == zero::Recompute::kAttentionOnly ? 2.0 * attn_params +
                                                                                  2.0 * cfg.num_layers * cfg.hidden_size * o.seq
                                                                            : 0.0;
  // Blocks past recompute_layers recompute whole blocks.
  const double kept = recompute_layers < 0 ? 1.0 : std::min<double>(1.0, double(recompute_layers) / cfg.num_layers);
  const double redone = mode_redone * kept + block_fwd * (1.0 - kept);
  b["recompute_est_s"] = compute * redone / (3 * block_fwd + redone + head_flops);
  b["optimizer_s"] = opt;
  if (mo.optimizer_on_host) {
    // The host AdamW's part of optimizer_s: the update on the host, and waiting for the gradients'
    // copies to the host (the rest: the norm and the last copies back).
    b["host_update_s"] = t[5].item<double>();
    b["host_copy_wait_s"] = t[6].item<double>();
    b["host_threads"] = model.host_optimizer()->threads();
  }
  r["breakdown"] = b;
  if (o.fp8) r["fp8"] = fp8_json(flops_tok, "mfu_vs_989");
  if (env.rank() == 0) {
    emit_json(r.dump(), o.out);
  }
  return 0;
}

}  // namespace

void add_bench_train(CLI::App* bench, Runner& run, int& argc, char**& argv) {
  auto* tr = bench->add_subcommand("train", "ZeRO-3 training steps of a preset shape (under mpirun, one rank per GPU)");
  auto o = std::make_shared<TrainBenchOptions>();
  tr->add_option("--model", o->model, "Preset shape: qwen2-0.5b, qwen2-1.5b, qwen2-7b, tiny-*");
  tr->add_option("--seq", o->seq, "Tokens per sequence")->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  tr->add_option("--micro-batch", o->micro_batch, "Sequences per rank per micro-batch")->check(CLI::Range(1, 4096));
  tr->add_option("--accumulate", o->accumulate,
                 "Micro-batches per optimizer step (their gradients add up; tiller train's train_batch_size / "
                 "micro-batch)")
      ->check(CLI::Range(1, 4096));
  tr->add_option("--sequence-parallel", o->sequence_parallel,
                 "Ranks that share each micro-batch (Ulysses); the --micro-batch sequences are per group")
      ->check(CLI::Range(1, 256));
  tr->add_option("--context-parallel", o->context_parallel,
                 "Of the --sequence-parallel ranks, groups that all-gather keys and values instead of splitting heads "
                 "(context parallelism; must divide it)")
      ->check(CLI::Range(1, 256));
  tr->add_option("--steps", o->steps, "Steps, the first two untimed")->check(CLI::Range(3, 10000));
  tr->add_option("--backend", o->backend, "auto (NCCL when GPUs are visible), nccl or mpi");
  add_logprob_match(tr, o->logprob_match);
  add_expert_kernels(tr, o->experts);
  tr->add_option("--chunk-rows", o->chunk_rows, "Rows per log-prob chunk")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  tr->add_option("--timeout", o->timeout_s, "Deadline of each collective, seconds")->check(CLI::Range(0.001, 1e7));
  tr->add_option("--out", o->out, "Also write the JSON here");
  tr->add_option("--recompute", o->recompute,
                 "auto (the most kept activations that fit the GPU; blocks on CPU), blocks, attention_only or none")
      ->check(CLI::IsMember({"auto", "blocks", "attention_only", "none"}));
  tr->add_option("--recompute-layers", o->recompute_layers,
                 "Blocks (from the first) that keep what --recompute keeps; -1: all (with auto, the plan picks)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 20));
  tr->add_option("--compute-shard", o->compute_shard,
                 "auto (keep when the memory plan fits it), keep (a persistent bf16 copy of the shards) or cast (each "
                 "gather casts the fp32 master shard)")
      ->check(CLI::IsMember({"auto", "keep", "cast"}));
  tr->add_option("--expandable-segments", o->expandable_segments,
                 "The caching allocator's expandable segments, as cluster.expandable_segments: auto (on where the "
                 "default allocator's fragmentation would not fit the GPU), on or off (a PYTORCH_CUDA_ALLOC_CONF "
                 "naming expandable_segments wins)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  tr->add_option("--optimizer-offload", o->optimizer_offload,
                 "none, or cpu: fp32 masters and AdamW moments in host memory, AdamW on the CPU")
      ->check(CLI::IsMember({"none", "cpu"}));
  tr->add_option("--optimizer-threads", o->optimizer_threads, "The CPU AdamW's threads per rank (0: cores / local ranks)")
      ->check(CLI::Range(0, 4096));
  tr->add_option("--gpu-memory-gb", o->gpu_memory_gb,
                 "GPU memory in GiB the plan checks against (0: the device's); on a larger GPU the caching allocator "
                 "is capped at it too")
      ->check(CLI::Range(0.0, 1e6));
  tr->add_option("--reduce-dtype", o->reduce_dtype, "What gradients are reduce-scattered in: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  tr->add_option("--profile", o->profile,
                 "Write a Chrome trace (torch.profiler format) of rank 0's last step here (with --fp8, the FP8 run's)");
  tr->add_flag("--fp8", o->fp8,
               "After the bf16 steps, time the same steps with FP8 training's GEMMs (roles.<r>.fp8) and report them "
               "beside, with the speedup");
  tr->add_option("--fp8-scaling", o->fp8_scaling, "The FP8 GEMMs' scales: block, channel or tensor")
      ->check(CLI::IsMember({"block", "channel", "tensor"}));
  tr->add_option("--fp8-accumulation", o->fp8_accumulation,
                 "Tensor scaling's forward GEMMs: fast (no fp32 promotion of the partial sums, "
                 "roles.<r>.fp8_fast_accumulation: true) or fp32")
      ->check(CLI::IsMember({"fast", "fp32"}));
  tr->add_flag("--score", o->score,
               "Time the actor's scoring pass (forward without autograd, log-probs and entropies to the host) "
               "instead of training steps");
  tr->add_flag("--frozen", o->frozen,
               "With --score: a frozen model, as the reference and reward roles hold (the compute shard only, "
               "no fp32 master or optimizer state)");
  tr->callback([&run, o, &argc, &argv] { run = [o, &argc, &argv] { return run_train_bench(*o, &argc, &argv); }; });
}

}  // namespace tiller::cli
