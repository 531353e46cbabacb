#include "trainer/role_worker.h"

#include <sys/resource.h>

#include <array>
#include <chrono>
#include <map>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/process.h"
#include "model/host_upload.h"
#include "model/torch_compat.h"
#include "tiller/algo/algo.h"
#include "tiller/core/clock.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/groups.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/dist/watchdog.h"
#include "tiller/model/model_config.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/storage_swap.h"
#include "tiller/model/transformer.h"
#include "tiller/sync/bucket_plan.h"
#include "tiller/sync/hybrid_handoff.h"
#include "tiller/engine/server.h"
#include "tiller/sync/weight_push.h"
#include "tiller/sync/weight_sync.h"
#include "tiller/zero/checkpoint.h"
#include "tiller/zero/sharded_model.h"
#include "trainer/losses.h"
#include "wire/messages.h"
#include "wire/trainer_groups.h"

namespace tiller::trainer {

namespace {

using Clock = std::chrono::steady_clock;

// The model directory a role loads: its own, else the actor's (ref, critic).
std::string role_model_dir(const JobConfig& cfg, Role role) {
  const RoleConfig& r = role_config(cfg, role);
  if (!r.model.empty()) return r.model;
  if (role == Role::kReward) throw ConfigError("roles.reward.model: the reward role needs a model directory");
  if (cfg.roles.actor.model.empty()) throw ConfigError("roles.actor.model: the actor needs a model directory");
  return cfg.roles.actor.model;
}

// One micro-batch (or, under sequence parallelism, this rank's slice of one) as the model takes it.
struct MicroBatch {
  zero::SequenceSlice slice;
  at::Tensor targets;    // [n]: each held row's next token (0 at a sequence's end)
  at::Tensor resp_rows;  // [R]: the held rows whose next token is a response token
  at::Tensor last_rows;  // the held rows that end a sequence
  at::Tensor routes;     // routing replay: the engine's experts of the held rows (the actor's forwards)
  // The slice as the actor takes it: with the engine's routes (the other roles route themselves).
  zero::SequenceSlice actor_slice() const {
    zero::SequenceSlice s = slice;
    s.routes = routes;
    return s;
  }
};

// The request's rows as the model takes them (messages.h has checked the lengths).
MicroBatch micro_batch(const wire::PackedSequences& m, at::Device dev) {
  const int64_t b = m.size(), first = m.first_row, n = m.held();
  const int64_t* tp = m.tokens.data_ptr<int64_t>();
  const int64_t* sl = m.seq_lens.data_ptr<int64_t>();
  const int64_t* pl = m.prompt_lens.data_ptr<int64_t>();
  // Token of row r of the packed row, for r in [first, first + n]: the row after the slice is next_token.
  auto token = [&](int64_t r) { return r < first + n ? tp[r - first] : m.next_token; };
  std::vector<int64_t> targets(static_cast<size_t>(n), 0), rows, last;
  MicroBatch mb;
  int64_t off = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t lo = std::max(off, first), hi = std::min(off + sl[i], first + n);  // held rows of sequence i
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t t = r - off;  // position in the sequence
      if (t + 1 < sl[i]) targets[static_cast<size_t>(r - first)] = token(r + 1);
      if (t >= pl[i] - 1 && t < sl[i] - 1) rows.push_back(r - first);
      if (t == sl[i] - 1) last.push_back(r - first);
    }
    mb.slice.seq_lens.push_back(sl[i]);
    off += sl[i];
  }
  mb.slice.tokens = m.tokens;
  mb.slice.first_row = first;
  mb.routes = m.routes;
  // Non-blocking uploads: the host goes on to queue this micro-batch's forward while the device
  // still runs the last one's backward.
  mb.targets = model::upload(targets, dev);
  mb.resp_rows = model::upload(rows, dev);
  mb.last_rows = model::upload(last, dev);
  return mb;
}

at::Tensor host_float(const at::Tensor& t) { return t.detach().to(at::kCPU, at::kFloat).contiguous(); }

// Spans a rank keeps for the controller's trace before it stops recording (nobody asks).
constexpr size_t kMaxSpans = 100000;
// Longest sleep between polls of an idle rank's inbox.
constexpr auto kMaxIdleBackoff = std::chrono::microseconds(2000);
// How long a failing rank offers its error to the controller before it ends.
constexpr double kErrorReplySeconds = 10;

}  // namespace

struct RoleWorker::Impl {
  const JobConfig& cfg;
  const dist::RankPlan& plan;
  int rank;
  dist::GroupCommunicators& groups;
  dist::Communicator& world;
  at::Device device;
  RoleSet roles;  // this rank's
  std::map<Role, std::unique_ptr<dist::Communicator>> sequence_groups;  // declared first: models refer to them
  std::map<Role, std::unique_ptr<zero::ShardedModel>> models;
  std::unique_ptr<sync::WeightSender> sender;
  // Standalone engines (engines.addresses / rendezvous_dir): the push, and a client per engine.
  std::unique_ptr<sync::WeightPusher> pusher;
  std::map<std::string, std::unique_ptr<engine::EngineClient>> engine_clients;
  std::unique_ptr<sync::HybridHandoff> handoff;  // hybrid: to this process's engine
  bool ref_is_actor_base = false;  // the reference's forwards are the actor's with its adapters off
  double temperature = 1.0;
  // logging.efficiency: this rank's benchmark rates at the job's shapes (tokens/s), measured once
  // per role: a training micro-batch's forward and backward, and a scoring forward.
  std::map<Role, double> bench_train, bench_score;
  // Statistics of the micro-batches since the role's last optimizer step: the host's, and the
  // losses' sums on the device (MicroBatchLoss::stats), read once, at the step.
  std::map<Role, wire::StepStats> acc;
  std::map<Role, at::Tensor> acc_device;
  std::map<Role, std::vector<std::string>> acc_metric_names;  // of acc_device[role]'s stats past the fourth
  std::vector<std::string> span_names;
  std::vector<double> span_begin, span_end;

  Impl(const JobConfig& c, const dist::RankPlan& p, int r, dist::GroupCommunicators& g, dist::Communicator& w,
       const std::string& dev)
      : cfg(c), plan(p), rank(r), groups(g), world(w), device(dev) {
    temperature = cfg.rollout.temperature > 0 ? cfg.rollout.temperature : 1.0;
    roles = plan.ranks.at(static_cast<size_t>(rank)).trainer_roles;
    ref_is_actor_base = cfg.ref_is_actor_base() && roles.has(Role::kRef);
    for (Role role : kRoles)
      if (roles.has(role) && !(role == Role::kRef && ref_is_actor_base)) load(role);
    if (ref_is_actor_base && rank == plan.group(Role::kActor)->ranks.front())
      log::info("ref: the actor's base with its LoRA adapters off (no second model loaded)");
    if (roles.has(Role::kActor) && groups.weight_sync && !plan.hybrid) {
      auto& actor = *models.at(Role::kActor);
      sender = std::make_unique<sync::WeightSender>(actor, *groups.weight_sync,
                                                    sync::job_bucket_plan(cfg, actor.config(), plan),
                                                    cfg.timeouts.weight_sync_s);
    }
    if (roles.has(Role::kActor) && cfg.engines.standalone()) {
      auto& actor = *models.at(Role::kActor);
      sync::PushOptions po;
      po.timeout_s = cfg.timeouts.weight_sync_s;
      po.chunk_bytes = static_cast<uint64_t>(cfg.engines.push_chunk_mb) << 20;
      po.threads = static_cast<int>(cfg.engines.push_threads);
      po.delta = cfg.engines.delta_sync;
      pusher = std::make_unique<sync::WeightPusher>(actor, sync::job_bucket_plan(cfg, actor.config(), plan), po);
    }
  }

  void load(Role role) {
    const std::string dir = role_model_dir(cfg, role);
    const model::ModelConfig mc = model::load_model_config(dir);
    const bool trainable = role_trains(role);
    const model::Head head = role == Role::kActor || role == Role::kRef ? model::Head::kLm : model::Head::kValue;
    dist::Communicator* comm = groups.role(role);
    TILLER_CHECK(comm != nullptr, "rank {} has role {} but no communicator for it", rank, role_name(role));
    comm->set_timeout(cfg.timeouts.collective_s);
    auto opts = zero::role_options(std::string(role_name(role)), role_config(cfg, role), cfg.train, trainable, head,
                                   device);
    const LoraConfig& lora = role_config(cfg, role).lora;
    // rank 0: none. The actor's seed is the engines' too (train_job.cpp); the critic draws its own.
    if (trainable) zero::apply_lora(opts, lora, mc, static_cast<uint64_t>(cfg.run.seed) + (role == Role::kCritic ? 1 : 0));
    auto m = std::make_unique<zero::ShardedModel>(mc, *comm, opts);
    if (opts.fp8 && comm->rank() == 0) log::info("{}: {}", role_name(role), zero::fp8_summary(opts));
    const dist::RoleGroup* group_plan = plan.group(role);
    TILLER_CHECK(group_plan != nullptr, "rank {} has role {} but the rank plan has no group for it", rank,
                 role_name(role));
    const int sp = group_plan->sequence_parallel;  // the role's own, or its host's when colocated
    if (sp > 1) {
      const std::string key = fmt::format("roles.{}.sequence_parallel", role_name(role));
      const int cp = static_cast<int>(role_config(cfg, role).context_parallel);
      zero::check_sequence_parallel(mc, sp, key, cp);
      TILLER_CHECK(comm->size() % sp == 0, "{} = {} does not divide the group's {} ranks", key, sp, comm->size());
      // Collective over the role's group: S consecutive ranks share each micro-batch.
      auto group = comm->split(comm->rank() / sp, comm->rank(), comm->name() + ".sequence");
      TILLER_CHECK(group != nullptr, "rank {}: no sequence group for {}", rank, role_name(role));
      group->set_timeout(cfg.timeouts.collective_s);
      m->set_sequence_group(*group, cp);  // collective over the group when cp > 1
      sequence_groups[role] = std::move(group);
    }
    model::CheckpointReader reader(dir);
    model::NamedTensors named = reader.all();
    if (head == model::Head::kValue && !named.count("score.weight")) {
      if (role == Role::kReward)
        throw ConfigError(fmt::format("roles.reward.model = {}: no 'score.weight'; a reward model needs a value head "
                                      "(a sequence-classification checkpoint with one label)",
                                      dir));
      // A critic started from a language model: a fresh value head that predicts 0 everywhere.
      named["score.weight"] = at::zeros({1, mc.hidden_size}, at::kFloat);
      if (comm->rank() == 0) log::info("critic: {} has no value head; starting one at zero", dir);
    }
    // LoRA: the adapters of lora.init_from, or PEFT's initialisation (load() draws it); the
    // engines start from the same (train_job.cpp).
    if (m->lora() && !lora.init_from.empty())
      for (auto& [n, t] : zero::initial_adapters(m->options(), lora, mc)) named[n] = t;
    m->load(named, dir);
    models[role] = std::move(m);
  }

  // The model that computes `role`'s forwards: the reference that is the actor's base is the actor.
  zero::ShardedModel& model_of(Role role) {
    return *models.at(role == Role::kRef && ref_is_actor_base ? Role::kActor : role);
  }

  // The forwards of `role` on `m`: the actor's base with its adapters off for such a reference.
  struct AdaptersOff {
    zero::ShardedModel* m = nullptr;
    AdaptersOff(zero::ShardedModel& model, bool off) : m(off ? &model : nullptr) {
      if (m) m->set_adapters_enabled(false);
    }
    ~AdaptersOff() {
      if (m) m->set_adapters_enabled(true);
    }
  };

  void span(const std::string& name, double begin_us) {
    if (span_names.size() > kMaxSpans) return;  // nobody asks for traces: stop recording
    span_names.push_back(name);
    span_begin.push_back(begin_us);
    span_end.push_back(wall_us());
  }

  // The benchmark of `role` at the job's shapes, as `tiller bench train` (or `--score`) times it:
  // the role's first micro-batch of the kind (its real sequences, so its real shapes) run once
  // untimed and kCalibrationIters times timed, back to back; training's gradients are dropped.
  // Collective over the role's group: its ranks receive their first request of each kind in the
  // same round, so they calibrate together.
  double calibrate(Role role, bool train, const MicroBatch& mb) {
    constexpr int kCalibrationIters = 2;
    zero::ShardedModel& m = model_of(role);
    const AdaptersOff off(m, role == Role::kRef && ref_is_actor_base);
    const bool lm = role == Role::kActor || role == Role::kRef;
    auto once = [&] {
      c10::AutoGradMode grad(train);
      at::Tensor entropy;
      const at::Tensor out = lm ? m.token_logprobs(mb.slice, mb.targets, temperature,
                                                   role == Role::kActor ? &entropy : nullptr)
                                : m.values(mb.slice);
      if (train) out.sum().mul(0.0).backward();  // the backward's work; no gradient kept
      else host_float(out);                      // as a scoring answer: back to the host
    };
    once();
    compat::synchronize(device);
    const auto t0 = Clock::now();
    for (int i = 0; i < kCalibrationIters; ++i) once();
    compat::synchronize(device);
    const double seconds = seconds_since(t0);
    if (train) m.zero_grad();
    const int64_t rows = static_cast<int64_t>(mb.targets.numel());
    const double rate = static_cast<double>(rows * kCalibrationIters) / std::max(seconds, 1e-9);
    log::info("{} {} benchmark at the job's shapes (its first micro-batch: {} tokens, {} sequences): {:.0f} tokens/s",
              role_name(role), train ? "training" : "scoring", rows, mb.slice.seq_lens.size(), rate);
    return rate;
  }

  wire::ScoreReply score(const wire::ScoreRequest& in) {
    c10::AutoGradMode no_grad(false);
    const MicroBatch mb = micro_batch(in.batch, device);
    wire::ScoreReply out;
    out.roles = wire::scored_roles(cfg.train.old_logprobs != OldLogprobs::kForward, roles);
    for (Role role : kRoles)
      if (out.roles.has(role) && cfg.logging.efficiency) {
        if (!bench_score.count(role)) bench_score[role] = calibrate(role, false, mb);
        out.bench[static_cast<size_t>(role_index(role))] = bench_score[role];
      }
    for (Role role : kRoles) {
      if (!out.roles.has(role)) continue;
      const auto t0 = Clock::now();
      const double w0 = wall_us();
      zero::ShardedModel& m = model_of(role);
      const AdaptersOff off(m, role == Role::kRef && ref_is_actor_base);
      switch (role) {
        case Role::kActor: {
          at::Tensor entropy;
          const at::Tensor lp = m.token_logprobs(mb.actor_slice(), mb.targets, in.temperature, &entropy);
          out.actor_logp = host_float(lp.index_select(0, mb.resp_rows));
          out.actor_entropy = host_float(entropy.index_select(0, mb.resp_rows));
          break;
        }
        case Role::kRef:
          out.ref_logp = host_float(m.token_logprobs(mb.slice, mb.targets, in.temperature, nullptr)
                                        .index_select(0, mb.resp_rows));
          break;
        case Role::kCritic: out.critic_values = host_float(m.values(mb.slice).index_select(0, mb.resp_rows)); break;
        case Role::kReward: out.reward_scores = host_float(m.values(mb.slice).index_select(0, mb.last_rows)); break;
      }
      out.seconds[static_cast<size_t>(role_index(role))] = seconds_since(t0);
      span("score." + std::string(role_name(role)), w0);
    }
    return out;
  }

  void train_actor(const wire::TrainActorRequest& in) {
    const MicroBatch mb = micro_batch(in.batch, device);
    if (cfg.logging.efficiency && !bench_train.count(Role::kActor)) {
      bench_train[Role::kActor] = calibrate(Role::kActor, true, mb);
      models.at(Role::kActor)->take_expert_load();  // the benchmark's forwards route no trained tokens
    }
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    zero::ShardedModel& m = *models.at(Role::kActor);
    at::Tensor entropy;
    at::Tensor lp = m.token_logprobs(mb.actor_slice(), mb.targets, temperature, &entropy);
    wire::StepStats& a = acc[Role::kActor];
    // Multi-turn samples: only the model's tokens train (losses.h applies the loss mask).
    ActorLossSpec spec;
    spec.clip = {cfg.algo.clip_eps_low, cfg.algo.clip_eps_high, cfg.algo.dual_clip};
    spec.kl_estimator = cfg.algo.kl_estimator;
    spec.policy_loss = cfg.algo.policy_loss;
    spec.entropy_coef = cfg.algo.entropy_coef;
    spec.old_is_forward = cfg.train.old_logprobs == OldLogprobs::kForward;
    const MicroBatchLoss l =
        actor_loss(lp.index_select(0, mb.resp_rows), entropy.index_select(0, mb.resp_rows), in, spec);
    // With a mixture of experts' router losses, when on.
    if (!l.loss.defined()) {
      // Lockstep: the group's collectives run on every rank (the router losses still train).
      m.add_router_loss(lp.sum() * 0, in.step_rows).backward();
    } else {
      m.add_router_loss(l.loss, in.step_rows).backward();
      accumulate(Role::kActor, l);
    }
    a.train_seconds += seconds_since(t0);
    span("train.actor", w0);
  }

  void train_critic(const wire::TrainCriticRequest& in) {
    const MicroBatch mb = micro_batch(in.batch, device);
    if (cfg.logging.efficiency && !bench_train.count(Role::kCritic)) {
      bench_train[Role::kCritic] = calibrate(Role::kCritic, true, mb);
      models.at(Role::kCritic)->take_expert_load();  // the benchmark's forwards route no trained tokens
    }
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    zero::ShardedModel& m = *models.at(Role::kCritic);
    at::Tensor v = m.values(mb.slice);
    wire::StepStats& a = acc[Role::kCritic];
    const MicroBatchLoss l = critic_loss(v.index_select(0, mb.resp_rows), in, {cfg.algo.value_loss, cfg.algo.value_clip});
    if (!l.loss.defined()) {
      m.add_router_loss(v.sum() * 0, in.step_rows).backward();
    } else {
      m.add_router_loss(l.loss, in.step_rows).backward();
      accumulate(Role::kCritic, l);
    }
    a.train_seconds += seconds_since(t0);
    span("train.critic", w0);
  }

  // Adds a micro-batch's statistics on the device, without waiting for it.
  void accumulate(Role role, const MicroBatchLoss& l) {
    at::Tensor& d = acc_device[role];
    std::vector<std::string>& names = acc_metric_names[role];
    if (d.defined() && names != l.metric_names)
      throw Error(fmt::format("rank {}: the policy loss {} reported the metrics [{}] on one micro-batch and [{}] on "
                              "another; report the same names every time",
                              rank, cfg.algo.policy_loss, fmt::join(names, ", "), fmt::join(l.metric_names, ", ")));
    names = l.metric_names;
    d = d.defined() ? d + l.stats : l.stats;
    acc[role].tokens += static_cast<double>(l.tokens);
  }

  wire::StepReply step(const wire::StepRequest& in) {
    TILLER_CHECK(roles.has(in.role), "rank {}: an optimizer step of {}, which this rank does not hold", rank,
                 role_name(in.role));
    wire::StepStats& a = acc[in.role];
    // The micro-batches were queued without waiting for the device: what they still run counts
    // as training, and their statistics come back in one copy.
    {
      const auto t0 = Clock::now();
      auto it = acc_device.find(in.role);
      if (it != acc_device.end()) {
        const at::Tensor s = it->second.cpu();
        const double* v = s.data_ptr<double>();
        a.loss += v[0];
        a.clip_tokens += v[1];
        a.approx_kl_tokens += v[2];
        a.entropy_sum += v[3];
        const std::vector<std::string>& names = acc_metric_names[in.role];
        for (size_t i = 0; i < names.size(); ++i) a.loss_metrics.emplace_back(names[i], v[4 + i]);
        acc_device.erase(it);
      }
      a.train_seconds += seconds_since(t0);
    }
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    const zero::StepResult r = models.at(in.role)->step(in.lr);
    wire::StepReply out;
    out.stats = acc[in.role];
    acc.erase(in.role);
    out.stats.grad_norm = r.grad_norm;
    out.stats.skipped = r.skipped;
    out.stats.step_seconds = seconds_since(t0);
    out.stats.bench_tokens_per_s = bench_train.count(in.role) ? bench_train.at(in.role) : 0.0;
    out.stats.peak_host_mb = peak_rss_mb();
    out.stats.peak_device_gb = static_cast<double>(compat::peak_allocated_bytes(device)) / (1024.0 * 1024.0 * 1024.0);
    if (const at::Tensor load = models.at(in.role)->take_expert_load(); load.defined()) {
      out.stats.expert_load = load.reshape({-1});
      out.stats.expert_load_experts = static_cast<double>(load.size(1));
    }
    const at::Tensor router = models.at(in.role)->take_router_stats();  // zeros without router losses
    out.stats.router_aux = router[0].item<double>();
    out.stats.router_z = router[1].item<double>();
    span("step." + std::string(role_name(in.role)), w0);
    return out;
  }

  // The push to standalone engines: every actor rank its buckets, to every engine the request names.
  wire::SyncReply push_weights(const wire::SyncRequest& in) {
    const double w0 = wall_us();
    std::vector<sync::PushTarget> targets;
    for (const std::string& a : in.targets) {
      auto& c = engine_clients[a];
      if (!c) c = std::make_unique<engine::EngineClient>(sync::standalone_engine_client(cfg, a));
      targets.push_back({"engine " + a, c.get()});
    }
    const sync::PushStats s = pusher->push(in.version, targets);
    wire::SyncReply reply{s.seconds, static_cast<double>(s.sent_bytes), {}};
    for (size_t j = 0; j < s.failed.size(); ++j)
      if (!s.failed[j].empty()) {
        log::warn("the push of weight version {} failed: {}", in.version, s.failed[j]);
        reply.failed.push_back(in.targets[j]);
      }
    span("sync", w0);
    return reply;
  }

  wire::SyncReply sync_weights(const wire::SyncRequest& in) {
    if (!in.targets.empty()) {
      TILLER_CHECK(pusher != nullptr, "rank {}: a push to standalone engines, but this rank pushes none", rank);
      return push_weights(in);
    }
    TILLER_CHECK(sender != nullptr || handoff != nullptr, "rank {}: a weight sync, but this rank sends none", rank);
    const double w0 = wall_us();
    // A hybrid rank's training blocks go back to the driver first: the sync's NCCL buffers are
    // allocated outside the caching allocator, and the engine's wake comes next.
    if (handoff) model::release_cached_device_memory(device);
    const sync::SyncStats s = handoff ? handoff->send(in.version) : sender->send(in.version);
    span("sync", w0);
    return {s.seconds, static_cast<double>(s.wire_bytes)};
  }

  wire::DoneReply save(const wire::SaveRequest& in) {
    const double w0 = wall_us();
    for (Role role : kRoles) {
      if (!roles.has(role) || !role_trains(role)) continue;  // frozen roles do not change
      zero::SaveOptions so;
      so.source_model = role_model_dir(cfg, role);
      zero::save_checkpoint(*models.at(role), in.dir + "/" + std::string(role_name(role)), so);
    }
    span("checkpoint", w0);
    return {};
  }

  wire::DoneReply load_state(const wire::LoadRequest& in) {
    for (Role role : kRoles)
      if (roles.has(role) && role_trains(role))
        zero::load_checkpoint(*models.at(role), in.dir + "/" + std::string(role_name(role)));
    return {};
  }

  // The hybrid engine's phases: the offloaded roles' state off the device or back.
  wire::PhaseReply phase(const wire::PhaseRequest& in) {
    const double w0 = wall_us();
    wire::PhaseReply out;
    for (Role role : kRoles) {
      if (!roles.has(role) || !role_config(cfg, role).offload || !models.count(role)) continue;
      zero::ShardedModel& m = *models.at(role);
      out.moved_bytes += static_cast<double>(in.offload ? m.offload_state() : m.reload_state());
    }
    // The phase ends here: its blocks go back to the driver before the engine's cache (offload) or
    // the training (reload) cuts the memory to its own sizes.
    model::release_cached_device_memory(device);
    const model::DeviceMemory d = model::device_memory(device);
    out.allocated = static_cast<double>(d.allocated);
    out.reserved = static_cast<double>(d.reserved);
    out.peak_allocated = static_cast<double>(d.peak_allocated);
    model::reset_peak_device_memory(device);
    span(in.offload ? "offload" : "reload", w0);
    return out;
  }

  wire::TraceReply trace() {
    wire::TraceReply out;
    out.names.swap(span_names);
    out.begin_us.swap(span_begin);
    out.end_us.swap(span_end);
    return out;
  }

  // The answer to `in`, if it has one.
  std::optional<wire::Frame> handle(wire::Frame in) {
    switch (in.op) {
      case wire::Op::kScore: return score(wire::ScoreRequest::decode(std::move(in))).encode();
      case wire::Op::kTrainActor: train_actor(wire::TrainActorRequest::decode(std::move(in))); return std::nullopt;
      case wire::Op::kTrainCritic: train_critic(wire::TrainCriticRequest::decode(std::move(in))); return std::nullopt;
      case wire::Op::kStep: return step(wire::StepRequest::decode(std::move(in))).encode();
      case wire::Op::kSync: return sync_weights(wire::SyncRequest::decode(std::move(in))).encode();
      case wire::Op::kSave: return save(wire::SaveRequest::decode(std::move(in))).encode();
      case wire::Op::kLoad: return load_state(wire::LoadRequest::decode(std::move(in))).encode();
      case wire::Op::kTrace: wire::TraceRequest::decode(std::move(in)); return trace().encode();
      case wire::Op::kPhase: return phase(wire::PhaseRequest::decode(std::move(in))).encode();
      default:
        throw CommError(fmt::format("rank {}: unexpected message '{}' from the controller", rank, wire::op_name(in.op)));
    }
  }
};

RoleWorker::RoleWorker(const JobConfig& cfg, const dist::RankPlan& plan, int rank, dist::GroupCommunicators& groups,
                       dist::Communicator& world, const std::string& device)
    : impl_(std::make_unique<Impl>(cfg, plan, rank, groups, world, device)) {}

RoleWorker::~RoleWorker() = default;

void RoleWorker::hand_off_to(sync::LocalWeightSink& sink) {
  Impl& m = *impl_;
  TILLER_CHECK(m.plan.hybrid && m.roles.has(Role::kActor) && m.groups.weight_sync,
               "rank {}: a hybrid handoff needs an actor rank of a hybrid plan", m.rank);
  auto& actor = *m.models.at(Role::kActor);
  m.handoff = std::make_unique<sync::HybridHandoff>(actor, *m.groups.weight_sync,
                                                    sync::job_bucket_plan(m.cfg, actor.config(), m.plan), sink,
                                                    m.cfg.timeouts.weight_sync_s);
}

void RoleWorker::serve() {
  Impl& m = *impl_;
  const int controller = m.plan.controller;
  // The longest the controller may stay silent towards this rank: a whole generation, the other
  // group's training, a sync and a collective's worth.
  const double idle_s = m.cfg.timeouts.generate_s + m.cfg.timeouts.train_s + m.cfg.timeouts.weight_sync_s +
                        m.cfg.timeouts.collective_s;
  std::vector<dist::WorkPtr> sending;
  auto reply = [&](const wire::Frame& f) {
    for (auto& w : sending) w->wait();
    sending = wire::send_frame(m.world, controller, f);
  };
  for (;;) {
    wire::IncomingFrame next(m.world, controller);
    const Deadline deadline = Deadline::after_seconds(idle_s);
    auto backoff = std::chrono::microseconds(50);
    std::optional<dist::WaitScope> waiting;
    while (!next.poll()) {
      if (!waiting) waiting.emplace(fmt::format("the controller's next request (rank {})", controller));
      if (deadline.expired())
        throw TimeoutError(fmt::format("rank {}: no message from the controller (rank {}) in {:.0f} s "
                                       "(timeouts.generate_s + train_s + weight_sync_s + collective_s); is it alive?",
                                       m.rank, controller, idle_s));
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, kMaxIdleBackoff);
    }
    waiting.reset();
    wire::Frame in = next.take();
    dist::Watchdog::set_phase(fmt::format("{} request", wire::op_name(in.op)));
    // The watchdog's tests: this rank never enters the collectives of the request.
    if (dist::fault_hang_requested(wire::op_name(in.op))) dist::hang_here(wire::op_name(in.op));
    try {
      if (in.op == wire::Op::kStop) {
        wire::StopRequest::decode(std::move(in));
        reply(wire::StopReply{peak_rss_mb()}.encode());
        for (auto& w : sending) w->wait();
        return;
      }
      if (std::optional<wire::Frame> out = m.handle(std::move(in))) reply(*out);
    } catch (const std::exception& e) {
      try {
        reply(wire::ErrorReply{e.what()}.encode());
        for (auto& w : sending) w->wait(Deadline::after_seconds(kErrorReplySeconds));
      } catch (...) {
      }
      throw;
    }
  }
}

}  // namespace tiller::trainer
