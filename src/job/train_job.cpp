#include "tiller/controller/prompt_source.h"
#include "tiller/controller/sample_loop.h"
#include "tiller/controller/step_hooks.h"
#include "tiller/job/train.h"
#include "tiller/reward/scorer_registry.h"

#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "controller/controller.h"
#include "core/process.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/core/signals.h"
#include "tiller/dist/groups.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/dist/watchdog.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/engine/server.h"
#include "tiller/job/memory_plan.h"
#include "tiller/model/model_config.h"
#include "tiller/model/numerics.h"
#include "tiller/model/storage_swap.h"
#include "tiller/sync/hybrid_handoff.h"
#include "tiller/sync/weight_sync.h"
#include "tiller/zero/checkpoint.h"
#include "tiller/zero/sharded_model.h"
#include "trainer/role_worker.h"
#include "wire/messages.h"

namespace tiller::job {
namespace {

// A fresh shared secret for the engines' gRPC services: only this job's controller can call them.
std::string random_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 32; ++i) t += "0123456789abcdef"[rd() % 16];
  return t;
}

// Waits for the controller's next frame without aborting the communicator on a long wait.
wire::Frame wait_for_controller(dist::Communicator& world, int controller, const std::function<void()>& check) {
  wire::IncomingFrame next(world, controller);
  auto backoff = std::chrono::microseconds(100);
  while (!next.poll()) {
    check();
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(20000));
  }
  return next.take();
}

// What a rank owns while it runs, held by run_train so that a failure ends the job with all of it
// alive (MpiEnv::fail_job): tearing down an engine or a ZeRO group mid-collective would block.
struct RankObjects {
  std::unique_ptr<trainer::RoleWorker> worker;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<sync::WeightReceiver> receiver;
  std::unique_ptr<engine::EngineServer> server;
  std::unique_ptr<sync::LocalWeightSink> sink;  // hybrid
  std::thread follower;                          // hybrid TP followers: the engine's follow()
  ~RankObjects() {
    if (follower.joinable()) follower.detach();  // only on a failure path, which ends the process
  }
};

// This rank's engine (its TP shard), as every engine rank builds it; `kv_bytes` > 0 sizes the KV
// cache (the memory plan's, for hybrid engines).
engine::Engine& make_engine(const JobConfig& cfg, const dist::RankPlan& plan, int rank,
                            dist::GroupCommunicators& groups, const std::string& device, int64_t kv_bytes,
                            bool start_asleep, RankObjects& own) {
  const auto& me = plan.ranks.at(static_cast<size_t>(rank));
  const int tp = plan.engine_tp();
  const std::string dir = cfg.engines.model.empty() ? cfg.roles.actor.model : cfg.engines.model;
  // Before the weights load: a context the model was not made for is a config error, not an
  // allocation of RoPE tables for it.
  const int64_t max_model_len = job::check_engine_context(cfg, model::load_model_config(dir), dir);
  engine::EngineWeights w = engine::load_engine_weights(dir, me.engine_tp_rank, tp, std::string(enum_name(cfg.roles.actor.dtype)), device);
  if (cfg.roles.actor.lora.rank > 0) {
    // The actor's adapters, unmerged beside the base as the trainer runs them, starting where the
    // actor starts (its init_from, or its seed's initialisation); each sync replaces them.
    zero::ShardedModelOptions lo;
    lo.role = "actor";
    zero::apply_lora(lo, cfg.roles.actor.lora, w.config, static_cast<uint64_t>(cfg.run.seed));
    engine::bind_lora_for_tp(w.config, lo.lora, zero::initial_adapters(lo, cfg.roles.actor.lora, w.config), w.weights,
                             me.engine_tp_rank, tp, device, "roles.actor.lora");
  }
  engine::EngineOptions eo;
  eo.device = device;
  eo.block_size = cfg.engines.kv_block_size;
  eo.gpu_memory_fraction = cfg.engines.gpu_memory_fraction;
  eo.kv_cache_gb = kv_bytes > 0 ? static_cast<double>(kv_bytes) / (1ull << 30) : cfg.engines.kv_cache_gb;
  eo.limits.max_num_seqs = cfg.engines.max_num_seqs;
  eo.limits.max_batched_tokens = cfg.engines.max_batched_tokens;
  eo.max_model_len = max_model_len;
  eo.session_timeout_s = cfg.engines.session_timeout_s;
  eo.max_sessions = cfg.engines.max_sessions;
  eo.quantization = std::string(enum_name(cfg.engines.quantization));
  eo.fp8_scaling = std::string(enum_name(cfg.engines.fp8_scaling));
  eo.kv_cache_dtype = std::string(enum_name(cfg.engines.kv_cache_dtype));
  eo.start_asleep = start_asleep;
  eo.record_routes = cfg.algo.routing_replay;
  if (cfg.logging.efficiency) {
    // The engine's benchmark (Engine::calibrate_if_due): its share of a step's samples as one
    // batch, prompts and responses as long as the job allows (capped: the calibration runs once,
    // at start or at a hybrid engine's first wake, and should take seconds).
    constexpr int64_t kBenchPromptCap = 256, kBenchNewCap = 512;
    const int64_t engines = std::max<int64_t>(1, static_cast<int64_t>(plan.engines.size()));
    const int64_t samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt;
    eo.bench_batch = std::min(cfg.engines.max_num_seqs, (samples + engines - 1) / engines);
    eo.bench_prompt = std::min(cfg.rollout.max_prompt_tokens, kBenchPromptCap);
    eo.bench_new_tokens = std::min(cfg.rollout.max_new_tokens, kBenchNewCap);
    // A hybrid engine calibrates inside the controller's wake call: well within its deadline.
    eo.bench_max_seconds = std::min(20.0, cfg.timeouts.rpc_s / 3);
  }
  dist::Communicator* tp_comm = tp > 1 ? groups.engine_tp.get() : nullptr;
  if (tp_comm) tp_comm->set_timeout(cfg.timeouts.collective_s);
  // A hybrid TP engine shares its GPUs with the trainers, which run their own collectives on them
  // from another thread: its followers wait for the leader's messages on the host, and its kernels
  // run on a stream of their own (engine.h: the control communicator, EngineOptions::own_stream).
  dist::Communicator* control = tp > 1 ? groups.engine_control.get() : nullptr;
  if (control) control->set_timeout(cfg.timeouts.collective_s);
  eo.own_stream = plan.hybrid && tp > 1 && device != "cpu";
  own.engine = std::make_unique<engine::Engine>(w.config, std::move(w.weights), eo, tp_comm, control);
  return *own.engine;
}

// The engine leader's gRPC service: the controller's secret in, the address out. Returns the server.
engine::EngineServer& serve_engine(const JobConfig& cfg, const dist::RankPlan& plan, int rank,
                                   dist::Communicator& world, const std::string& hostname, RankObjects& own) {
  const auto& me = plan.ranks.at(static_cast<size_t>(rank));
  const wire::EngineHello hello =
      wire::EngineHello::decode(wire::recv_frame(world, plan.controller, Deadline::after_seconds(cfg.timeouts.startup_s)));
  engine::ServerOptions so;
  const int64_t port = cfg.engines.port == 0 ? 0 : cfg.engines.port + me.engine;
  so.address = fmt::format("{}:{}", cfg.engines.host, port);
  so.token = hello.token;
  so.tls.cert = cfg.engines.tls_cert;
  so.tls.key = cfg.engines.tls_key;
  so.max_wait_seconds = std::max(cfg.timeouts.weight_sync_s, cfg.timeouts.rpc_s);
  own.server = std::make_unique<engine::EngineServer>(*own.engine, so);
  const wire::EngineAddress addr{fmt::format("{}:{}", hostname, own.server->port())};
  for (auto& wk : wire::send_frame(world, plan.controller, addr.encode()))
    wk->wait(Deadline::after_seconds(cfg.timeouts.startup_s));
  log::info("engine {} serving on {} ({} KV blocks, pid {})", me.engine, addr.address,
            own.engine->stats().kv_blocks_total, static_cast<int64_t>(getpid()));
  return *own.server;
}

int run_engine_rank(const JobConfig& cfg, const dist::RankPlan& plan, int rank, dist::GroupCommunicators& groups,
                    dist::Communicator& world, const std::string& device, const std::string& hostname,
                    RankObjects& own) {
  const auto& me = plan.ranks.at(static_cast<size_t>(rank));
  engine::Engine& eng = make_engine(cfg, plan, rank, groups, device, 0, false, own);
  TILLER_CHECK(groups.weight_sync != nullptr, "engine rank {} has no weight-sync communicator", rank);
  own.receiver = std::make_unique<sync::WeightReceiver>(eng, *groups.weight_sync, cfg.timeouts.weight_sync_s);
  eng.set_weight_sink(own.receiver.get());
  if (!eng.is_leader()) {
    eng.follow();
    return 0;
  }
  eng.calibrate_if_due();  // logging.efficiency: before serving (its followers follow already)
  engine::EngineServer& server = serve_engine(cfg, plan, rank, world, hostname, own);
  wire::StopRequest::decode(wait_for_controller(world, plan.controller, [&] {
    const std::string failure = server.error();
    if (!failure.empty()) throw Error(fmt::format("engine {}: its loop failed: {}", me.engine, failure));
  }));
  server.shutdown();
  eng.shutdown();
  const engine::EngineStats s = eng.stats();
  log::info("engine {}: {} requests, {} generated tokens in {} steps", me.engine, s.requests_finished,
            s.generated_tokens, s.steps);
  for (auto& wk : wire::send_frame(world, plan.controller, wire::StopReply{peak_rss_mb()}.encode()))
    wk->wait(Deadline::after_seconds(cfg.timeouts.rpc_s));
  return 0;
}

// cluster.hybrid: an actor rank that also runs its engine's TP rank, in this process. The engine
// starts asleep (its KV cache is allocated at the first generate phase) and receives the weights
// from the actor on the device (sync/hybrid_handoff.h). The leader serves gRPC on its server's
// loop thread, a follower follows on a thread of its own; the trainer serves the controller on
// this thread until it says stop.
int run_hybrid_rank(const JobConfig& cfg, const dist::RankPlan& plan, int rank, dist::GroupCommunicators& groups,
                    dist::Communicator& world, const std::string& device, const std::string& hostname,
                    int64_t kv_bytes, RankObjects& own) {
  own.worker = std::make_unique<trainer::RoleWorker>(cfg, plan, rank, groups, world, device);
  engine::Engine& eng = make_engine(cfg, plan, rank, groups, device, kv_bytes, /*start_asleep=*/true, own);
  own.sink = std::make_unique<sync::LocalWeightSink>(eng, cfg.timeouts.weight_sync_s);
  eng.set_weight_sink(own.sink.get());
  own.worker->hand_off_to(*own.sink);
  if (eng.is_leader()) {
    serve_engine(cfg, plan, rank, world, hostname, own);
  } else {
    own.follower = std::thread([&eng, rank, device] {
      try {
        if (device != "cpu")
          c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(at::Device(device));
        eng.follow();
      } catch (const std::exception& e) {
        dist::MpiEnv::fail_job(rank, e);
      }
    });
  }
  own.worker->serve();
  if (eng.is_leader()) {
    own.server->shutdown();
    eng.shutdown();  // ends the followers' follow()
  } else {
    own.follower.join();
  }
  return 0;
}

// One rank's part of the job: the controller, an engine rank or a trainer rank.
int run_rank(const JobConfig& cfg, dist::MpiEnv& env, const TrainOptions& options, const dist::RankPlan& plan,
             const dist::RankAssignment& me, dist::GroupCommunicators& groups, dist::Communicator& world,
             const std::string& device, int64_t hybrid_kv_bytes, RankObjects& own) {
  if (env.rank() == plan.controller) {
    StopSignalWatcher watcher([] {
      log::warn("signal received: finishing this step, saving a checkpoint, then stopping");
      controller::request_stop();
    });
    // The engines' shared secret, then their addresses.
    controller::ControllerOptions co;
    co.engine_token = random_token();
    co.require_resume = options.require_resume;
    std::vector<std::vector<dist::WorkPtr>> sends;
    for (const auto& e : plan.engines) sends.push_back(wire::send_frame(world, e.ranks.front(), wire::EngineHello{co.engine_token}.encode()));
    for (const auto& e : plan.engines)
      co.engine_addresses.push_back(
          wire::EngineAddress::decode(wire::recv_frame(world, e.ranks.front(), Deadline::after_seconds(cfg.timeouts.startup_s)))
              .address);
    for (auto& v : sends)
      for (auto& w : v) w->wait(Deadline::after_seconds(cfg.timeouts.startup_s));
    return controller::run_controller(cfg, plan, world, co);
  }
  if (me.engine >= 0 && !me.trainer_roles.empty())
    return run_hybrid_rank(cfg, plan, env.rank(), groups, world, device, env.hostname(), hybrid_kv_bytes, own);
  if (me.engine >= 0) return run_engine_rank(cfg, plan, env.rank(), groups, world, device, env.hostname(), own);
  own.worker = std::make_unique<trainer::RoleWorker>(cfg, plan, env.rank(), groups, world, device);
  own.worker->serve();
  return 0;
}

}  // namespace

int run_train(const JobConfig& cfg, dist::MpiEnv& env, const TrainOptions& options) {
  // SIGINT/SIGTERM: the controller finishes its step and saves; the other ranks wait for its stop.
  block_stop_signals();
  // A job built in code (not through algo::load_job) gets the algorithm's checks here, before any
  // rank starts: every rank sees the same registrations, so every rank refuses alike.
  algo::check_config(cfg);
  controller::parse_step_hooks(cfg.train.step_hooks);
  controller::find_prompt_source(cfg.data.source);
  controller::job_sample_loop(cfg);
  if (const std::string scorer = reward::job_batch_scorer(cfg); !scorer.empty()) reward::find_batch_scorer(scorer);

  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  const dist::DeviceChoice placed =
      dist::choose_device(cfg.cluster, gpus, dist::MpiEnv::have_nccl(), env.rank(), env.hostname());
  const bool cpu = placed.cpu;
  const BackendKind backend = placed.backend;
  dist::check_layout_on_backend(cfg, backend);
  // What the ranks run: cluster.hybrid_scoring resolved for this backend (the memory plan and the
  // controller read it), and below, the recompute mode and compute shard the ranks agree on.
  JobConfig job = cfg;
  if (job.cluster.hybrid)
    job.cluster.hybrid_scoring =
        cfg.hybrid_scores_after_generate(backend) ? HybridScoring::kAfterGenerate : HybridScoring::kOverlap;
  if (cfg.algo.logprob_match == LogprobMatch::kBitwise)
    model::set_numerics(model::Numerics::kBatchInvariant);  // every rank, before its first forward

  auto world = env.world(cfg.timeouts.startup_s);
  const dist::NodeMap nodes = env.node_map(static_cast<int>(cfg.cluster.gpus_per_node), cpu, cfg.timeouts.startup_s);
  const int needed = dist::required_world_size(cfg);
  if (env.size() != needed)
    throw ConfigError(fmt::format("this config needs {} ranks ({}), the job has {}; run it with mpirun -np {} "
                                  "(tiller plan prints the whole line)",
                                  needed, dist::world_size_breakdown(cfg), env.size(), needed));
  const dist::RankPlan plan = dist::make_rank_plan(cfg, nodes);
  const auto& me = plan.ranks.at(static_cast<size_t>(env.rank()));
  log::init(env.rank(), me.label(), log::parse_level(cfg.logging.level, "logging.level"));
  // Collective over the world: from here a rank that fails, or a wait past its deadline, ends the
  // job with one line from every rank saying where it was (dist/watchdog.h).
  dist::Watchdog::start(env.rank(), me.label());
  set_process_label(fmt::format("rank {} ({})", env.rank(), me.label()));
  std::string device = "cpu";
  if (!cpu && me.gpu >= 0) {
    device = fmt::format("cuda:{}", me.gpu);
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(me.gpu)));
  }
  // The default generators, whose states checkpoints save, from the run's seed and the rank.
  zero::seed_default_generators(static_cast<uint64_t>(cfg.run.seed), env.rank(), at::Device(device));
  // The memory plan: on GPUs every rank checks that its phases fit (the same verdict everywhere),
  // and a hybrid engine's KV cache is what its generate phase leaves.
  int64_t gpu_bytes = static_cast<int64_t>(cfg.cluster.gpu_memory_gb * (1ull << 30));
  if (gpu_bytes == 0 && !cpu && me.gpu >= 0) gpu_bytes = model::device_memory(at::Device(device)).total;
  // On a larger card than cluster.gpu_memory_gb, the rank allocates no more than that: the job
  // runs out of memory where it would on the card it was planned for.
  if (!cpu && me.gpu >= 0 && cfg.cluster.gpu_memory_gb > 0)
    if (const int64_t total = model::cap_device_memory(at::Device(device), gpu_bytes); total > 0)
      log::info("cluster.gpu_memory_gb = {}: the caching allocator holds at most that of {}'s {:.1f} GiB",
                cfg.cluster.gpu_memory_gb, device, static_cast<double>(total) / (1ull << 30));
  std::string missing;
  const ModelShapes shapes = load_model_shapes(cfg, &missing);
  MemoryPlan memory;
  if (missing.empty()) memory = plan_memory(job, plan, shapes, cpu ? 0 : gpu_bytes);
  if (!cpu) check_fits(memory, job);
  // train.recompute: every rank takes the least-memory mode any rank planned (GPUs of different
  // sizes plan differently; a sequence group's exchanges need one mode). Collective over the world.
  // train.compute_shard likewise: cast (0) if any rank planned it. A rank with no GPU size to plan
  // with (the controller, unless cluster.gpu_memory_gb is set) has no say: its plan is the least
  // memory by default, and would otherwise hold every GPU rank to it.
  {
    const bool sized = gpu_bytes > 0 && !cpu;
    // No say: above every choice (no rank sized at all, on CPU: each keeps its least-memory plan).
    constexpr double kNoSay = 1e12;
    // cluster.expandable_segments likewise: on (0) if any rank planned it.
    at::Tensor choice = at::tensor({sized ? recompute_order(memory.recompute, memory.recompute_layers) : kNoSay,
                                    sized ? (memory.keep_compute_shard ? 1.0 : 0.0) : kNoSay,
                                    sized ? (memory.expandable_segments ? 0.0 : 1.0) : kNoSay},
                                   at::kDouble);
    world->all_reduce(choice, dist::ReduceOp::kMin)->wait();
    const bool gpu_ranks_chose = choice[0].item<double>() < kNoSay;
    if (!gpu_ranks_chose) {
      choice[0] = recompute_order(memory.recompute, memory.recompute_layers);
      choice[1] = memory.keep_compute_shard ? 1.0 : 0.0;
      choice[2] = memory.expandable_segments ? 0.0 : 1.0;
    }
    const auto [agreed, layers] = recompute_from_order(choice[0].item<double>());
    if (agreed != memory.recompute || layers != memory.recompute_layers)
      memory.recompute_reason += "; lowered to what another rank planned";
    memory.recompute = agreed;
    memory.recompute_layers = layers;
    job.train.recompute = zero::recompute_choice(memory.recompute);
    job.train.recompute_layers = layers;
    const bool keep = choice[1].item<double>() > 0.5;
    if (keep != memory.keep_compute_shard) memory.compute_shard_reason += "; cast as another rank planned";
    memory.keep_compute_shard = keep;
    job.train.compute_shard = keep ? ComputeShard::kKeep : ComputeShard::kCast;
    const bool expandable = choice[2].item<double>() < 0.5;
    if (expandable != memory.expandable_segments) memory.allocator_reason += "; on, as another rank planned";
    memory.expandable_segments = expandable;
    job.cluster.expandable_segments = expandable ? ExpandableSegments::kOn : ExpandableSegments::kOff;
    // The table of what was agreed (the controller's shows the GPU ranks' choice).
    if (missing.empty()) {
      const std::string mode_why = memory.recompute_reason, shard_why = memory.compute_shard_reason,
                        allocator_why = memory.allocator_reason;
      memory = plan_memory(job, plan, shapes, cpu ? 0 : gpu_bytes);
      memory.recompute_reason = sized || !gpu_ranks_chose ? mode_why : "as the GPU ranks planned";
      memory.compute_shard_reason = sized || !gpu_ranks_chose ? shard_why : "as the GPU ranks planned";
      memory.allocator_reason = sized || !gpu_ranks_chose ? allocator_why : "as the GPU ranks planned";
    }
  }
  // The caching allocator of a GPU rank, before its models load (job/memory_plan.h says why).
  if (!cpu && me.gpu >= 0) model::set_expandable_segments(memory.expandable_segments);
  int64_t kv_bytes = 0;
  for (const auto& r : memory.ranks)
    if (r.rank == env.rank() && plan.hybrid) kv_bytes = r.kv_cache_bytes;
  if (env.rank() == plan.controller) {
    log::info("controller pid {}; rank plan:\n{}", static_cast<int64_t>(getpid()), plan.table());
    // On CPU the table matters for the hybrid engine and for what an optimizer on the host holds.
    bool host_optimizer = false;
    for (const auto& r : memory.ranks) host_optimizer = host_optimizer || r.host_bytes > 0;
    if (plan.hybrid || !cpu || host_optimizer) log::info("{}", memory.table());
  }

  dist::DeviceComm to_device;
  if (backend == BackendKind::kNccl)
    to_device = [&](dist::Communicator& group, const std::string& name) -> std::unique_ptr<dist::Communicator> {
      // NCCL refuses two ranks on one GPU (cluster.ranks_per_gpu > 1): such a group goes through the host.
      if (dist::shares_a_device(group, me.node, me.gpu)) {
        if (group.rank() == 0)
          log::info("group '{}' has ranks that share a GPU: its collectives go through the host (MPI)", name);
        return dist::host_staged(group.split(0, group.rank(), name));
      }
      return dist::MpiEnv::nccl(group, me.gpu, name, cfg.timeouts.startup_s);
    };
  dist::GroupCommunicators groups = dist::make_group_communicators(plan, *world, to_device);
  world->set_timeout(cfg.timeouts.collective_s);

  // From here a failing rank prints its error and ends the job at once, before anything it owns
  // is destroyed: a peer blocked in a collective with it (a ZeRO-3 gather, a TP all-reduce) would
  // otherwise hold up the teardown of its communicators until their deadline, minutes later.
  RankObjects own;
  try {
    return run_rank(job, env, options, plan, me, groups, *world, device, kv_bytes, own);
  } catch (const std::exception& e) {
    dist::MpiEnv::fail_job(env.rank(), e);
  }
}

}  // namespace tiller::job
