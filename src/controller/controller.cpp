#include "controller/controller.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "controller/advantages.h"
#include "controller/standalone_engines.h"
#include "controller/evaluator.h"
#include "controller/hook_runner.h"
#include "controller/hybrid_phases.h"
#include "controller/off_policy.h"
#include "controller/step_metrics.h"
#include "controller/step_trace.h"
#include "controller/training_dispatch.h"
#include "core/process.h"
#include "python/tracking.h"
#include "tiller/algo/algo.h"
#include "tiller/core/clock.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/dist/watchdog.h"
#include "tiller/zero/checkpoint.h"
#include "zero/run_checkpoints.h"

namespace tiller::controller {
namespace {

using json = nlohmann::ordered_json;

std::atomic<bool> g_stop{false};

// How long the controller waits for a completion when a round brought nothing (ms): the latency
// of noticing a rank's answer.
constexpr int kIdleWaitMs = 1;

std::string hms(double s) {
  const auto t = static_cast<int64_t>(std::max(0.0, s));
  return fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60);
}

// The wall clock (trace time) at steady time `t`.
double wall_us_at(const Clock& clock, Clock::time_point t) {
  return wall_us() - 1e6 * std::chrono::duration<double>(clock.now() - t).count();
}

int64_t restarts_of_this_run() {
  const char* v = std::getenv("TILLER_RESTARTS");
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return *end == '\0' && n >= 0 && n < 1000000 ? n : -1;
}

double value_or(const json& j, const char* key, double fallback = 0) {
  return j.contains(key) ? j[key].get<double>() : fallback;
}

}  // namespace

void request_stop() { g_stop = true; }
bool stop_requested() { return g_stop; }

struct Controller::Impl {
  const JobConfig& cfg;
  ControllerWiring w;
  const dist::RankPlan& plan;
  std::vector<wire::TrainerGroup> groups;
  const wire::TrainerGroup* actor_group = nullptr;
  const wire::TrainerGroup* critic_group = nullptr;
  std::vector<int> trainers;  // every trainer rank once
  wire::TrainerLink link;
  CollectorConfig collect_cfg;
  std::unique_ptr<RolloutCollector> collector;
  std::unique_ptr<TrainingDispatch> training;
  AdvantageSpec adv_spec;
  OffPolicySpec off_policy_spec;
  zero::RunCheckpoints checkpoints;
  std::unique_ptr<StepTrace> trace;
  std::unique_ptr<StepOutputs> outputs;
  std::unique_ptr<HybridPhases> hybrid;  // cluster.hybrid
  bool score_after_generate = false;      // cluster.hybrid_scoring, resolved
  StepHookRunner hooks;                   // train.step_hooks
  uint64_t plan_id = 0;

  // Run state (what a checkpoint keeps).
  int64_t step = 0;      // completed steps
  uint64_t version = 0;  // the engines' weight version (number of syncs)
  algo::KlController kl_ctl;
  algo::RunningMoments reward_moments;
  std::vector<PendingPrompt> resend;
  int64_t next_ordinal = 0;

  // This step.
  json metrics;
  SteadyClock::time_point run_start, step_end;
  std::vector<engine::EngineStats> engine_stats;  // the engines' counters at the last step's end
  std::vector<engine::EngineStats> session_stats;  // multi-turn jobs: theirs when the last batch was ready
  double sync_seconds_on_actor = 0, sync_wire_bytes = 0;
  json summary = json::object();
  // efficiency/* summed over the run's first step (which calibrates the benchmarks) and the later
  // ones: (sum, steps) per metric.
  std::map<std::string, std::pair<double, int>> first_efficiency, efficiency_sums;
  json last_metrics;
  int64_t first_step = 0;  // completed steps when this run began (after a resume)
  // Times `tiller launch` restarted this job ($TILLER_RESTARTS; -1 when not supervised).
  int64_t restarts = restarts_of_this_run();

  Impl(const JobConfig& c, const ControllerWiring& wiring)
      : cfg(c),
        w(wiring),
        plan(*wiring.plan),
        link(*wiring.channel,
             [p = wiring.plan](int r) { return fmt::format("rank {} ({})", r, p->ranks.at(static_cast<size_t>(r)).label()); },
             *wiring.clock),
        checkpoints(c.checkpoint.dir, c.checkpoint.keep_last),
        hooks(c.train.step_hooks),
        kl_ctl(c.algo.kl_coef, c.algo.target_kl, c.algo.kl_horizon) {
    groups = wire::trainer_groups(plan);
    for (const auto& g : groups) {
      if (g.has(Role::kActor)) actor_group = &g;
      if (g.has(Role::kCritic)) critic_group = &g;
    }
    TILLER_CHECK(actor_group != nullptr, "the rank plan has no actor group");
    trainers = wire::trainer_ranks(groups);
    const bool have_ref = plan.group(Role::kRef) != nullptr;
    collect_cfg = CollectorConfig::from_job(cfg, w.stop_token_ids, have_ref, critic_group != nullptr);
    collect_cfg.clock = w.clock;
    adv_spec = AdvantageSpec::from_job(cfg, have_ref);
    off_policy_spec = OffPolicySpec::from_job(cfg);
    TrainingConfig train_cfg = TrainingConfig::from_job(cfg, have_ref);
    train_cfg.attention_tokens = w.attention_tokens;
    training = std::make_unique<TrainingDispatch>(train_cfg, link, actor_group, critic_group);
    std::vector<std::string> labels;
    for (const auto& a : plan.ranks) labels.push_back(a.label());
    const std::string out = cfg.run.output_dir;
    trace = std::make_unique<StepTrace>(cfg.logging.profile_steps,
                                        cfg.logging.chrome_trace.empty() ? out + "/trace.json" : cfg.logging.chrome_trace,
                                        labels, plan.controller);
    StepOutputOptions so;
    so.metrics_jsonl = cfg.logging.metrics_jsonl.empty() ? out + "/metrics.jsonl" : cfg.logging.metrics_jsonl;
    so.tensorboard_dir = cfg.logging.tensorboard_dir.empty() ? out + "/tensorboard" : cfg.logging.tensorboard_dir;
    so.records = cfg.logging.rollout_records;
    so.record_tokens = cfg.logging.rollout_records_tokens;
    so.record_text = cfg.logging.rollout_records_text;
    so.samples_per_step = cfg.logging.samples_per_step;
    so.samples_jsonl = cfg.logging.samples_jsonl.empty() ? out + "/samples.jsonl" : cfg.logging.samples_jsonl;
    so.decode = w.decode_text;
    so.tracking = w.tracking;
    outputs = std::make_unique<StepOutputs>(std::move(so));
    if (plan.hybrid) hybrid = std::make_unique<HybridPhases>(cfg, *w.engines, link, trainers, *trace);
    score_after_generate = plan.hybrid && cfg.hybrid_scores_after_generate(planned_backend(cfg.cluster));
  }

  HybridPhases::Put put_metric() {
    return [this](const std::string& k, double v) { metrics[k] = v; };
  }

  // Hybrid: the step's samples are all in; the engines sleep and the trainers take the GPUs.
  void hybrid_train_phase(int64_t j, bool sync_follows) {
    collector->pause_dispatch(true);
    while (collector->in_flight_samples() > 0) pump();
    hybrid->train(j, sync_follows, put_metric());
  }

  // Hybrid: the trainers give the GPUs back and the engines generate the next step (an evaluation
  // before it may have woken them already).
  void hybrid_generate_phase(int64_t j) {
    if (!hybrid->generating()) hybrid->generate(j, put_metric());
    collector->hold_scoring(score_after_generate);
    collector->pause_dispatch(false);
  }

  // Hybrid, cluster.hybrid_scoring = after_generate: once the step's samples are all in (and any
  // extra ones in flight), the engines free their caches and the trainers score.
  void hybrid_score_phase(int64_t j) {
    while (!collector->generation_done()) pump();
    collector->pause_dispatch(true);
    while (collector->in_flight_samples() > 0) pump();
    hybrid->score(j, put_metric());
    collector->hold_scoring(false);
  }

  // eval.prompts after `done` completed steps, when due: on the engines at the current weights
  // (between steps no update comes), woken first in a hybrid job; the metrics join this step's.
  void evaluate(int64_t done, bool last) {
    if (w.evaluator == nullptr || !w.evaluator->due(done, last)) return;
    dist::Watchdog::set_phase(fmt::format("evaluation after step {}", done));
    if (hybrid && !hybrid->generating()) hybrid->generate(done + 1, put_metric());
    const double w0 = wall_us();
    {
      dist::WaitScope wait(fmt::format("the evaluation's {} prompts on the engines", w.evaluator->prompts()));
      for (const auto& [k, v] : w.evaluator->run(done, version, [this] { pump(); })) metrics[k] = v;
    }
    trace->span(done, "eval", -1, w0, wall_us());
  }

  // --- background work ---------------------------------------------------------------------------

  // Seconds from `t` (taken from w.clock, as every time point here is) to now on that clock.
  double since(SteadyClock::time_point t) const { return seconds_between(t, w.clock->now()); }

  // One round of what runs all along: the collector, the ranks' answers, the training's posts.
  // Waits up to kIdleWaitMs for a completion when nothing happened; true when anything did.
  bool pump() {
    bool any = collector->pump(0);
    any = link.poll() > 0 || any;
    any = training->pump() || any;
    if (!any) any = collector->pump(kIdleWaitMs);
    return any;
  }

  // Waits (pumping) until no call to `ranks` is pending.
  void drain(const std::vector<int>& ranks) {
    link.drain(ranks, [&] { collector->pump(kIdleWaitMs); });
  }

  // --- one step -----------------------------------------------------------------------------------

  std::unique_ptr<StepBatch> next_batch() {
    const auto t0 = w.clock->now();
    while (!collector->batch_ready()) pump();
    if (cfg.multi_turn()) {
      // On-policy, no turn of the next step has started yet: the session counters are this step's.
      std::vector<engine::EngineStats> now = w.engines->stats();
      session_metrics(session_stats, now, metrics);
      session_stats = std::move(now);
    }
    const int64_t j = collector->forming_step();
    after_scoring_hooks(j);
    const bool empty = collector->forming().ro.size() == 0;  // nothing informative (filter cap)
    RoleSet will_train;
    if (j > cfg.train.critic_warmup_steps && !empty) will_train.add(Role::kActor);
    if (critic_group && !empty) will_train.add(Role::kCritic);
    std::unique_ptr<StepBatch> b = collector->take_batch(will_train);
    // From here the samples are in (prompt, sample) order, not arrival order: the advantages'
    // sums (whitening, reward normalisation, the KL controller's input) and the training's
    // micro-batches are then the same in every run of a job.
    b->ro.canonicalize();
    if (w.rewards.batched) w.rewards.batched->label_step(static_cast<uint64_t>(j + 1));
    metrics["time/wait_batch"] = since(t0);
    return b;
  }

  // train.step_hooks' after_scoring: the ready step's scores, and the groups they drop.
  void after_scoring_hooks(int64_t j) {
    if (!hooks.has_after_scoring()) return;
    const auto t0 = w.clock->now();
    StepBatch& b = collector->ready_batch();
    const std::vector<uint8_t> keep = hooks.after_scoring(
        j, cfg.rollout.n_samples_per_prompt, b.ro, static_cast<int64_t>(b.groups.size()),
        [&](int64_t g) -> const data::Prompt& { return w.prompts->at(b.groups[static_cast<size_t>(g)].dataset_index); },
        w.rewards.decode);
    metrics["hooks/dropped_groups"] = static_cast<double>(std::count(keep.begin(), keep.end(), uint8_t{0}));
    collector->drop_ready_groups(keep);
    metrics["time/hooks"] = since(t0);
  }

  void advantages(StepBatch& b) {
    const auto t0 = w.clock->now();
    AdvantageResult r = compute_advantages(b.ro, adv_spec, {kl_ctl.value(), reward_moments});
    b.ro.advantages = std::move(r.advantages);
    if (b.ro.layout.critic) b.ro.returns = std::move(r.returns);
    reward_moments = r.state.reward_moments;
    kl_ctl.update(r.kl_mean_per_sample, b.ro.size());
    for (const auto& [k, v] : r.metrics) metrics[k] = v;
    metrics["time/advantage"] = since(t0);
  }

  void train(const StepBatch& b, const OffPolicy& op, bool train_actor) {
    const auto t0 = w.clock->now();
    const double w0 = wall_us();
    training->start(b, op, train_actor, kl_ctl.value());
    bool critic_released = !critic_group;
    while (!training->done()) {
      pump();
      if (!critic_released && training->posted(Role::kCritic)) {
        collector->release(Role::kCritic);
        critic_released = true;
      }
    }
    if (!critic_released) collector->release(Role::kCritic);
    for (const auto& [k, v] : training->metrics()) metrics[k] = v;
    metrics["time/train"] = since(t0);
    for (const auto& [k, v] : training->efficiency(metrics["time/train"].get<double>())) metrics[k] = v;
    trace->span(b.step, "train", -1, w0, wall_us());
    if (train_actor) {
      sync_weights(b.step);
    } else {
      collector->release(Role::kActor);
    }
  }

  // The weights of the actor to every engine at version `v` (the engines pause for it).
  void push_weights(uint64_t v) {
    if (hybrid) hybrid->before_sync(step + 1, put_metric());
    if (w.standalone) w.standalone->admit(*w.engines, *collector, v);
    w.engines->begin_update(v, plan_id);
    sync_seconds_on_actor = sync_wire_bytes = 0;
    std::vector<std::string> failed;  // standalone engines an actor rank could not push to
    for (int rank : actor_group->ranks)
      link.call(rank, wire::SyncRequest{v, w.standalone ? w.standalone->targets(*w.engines) : std::vector<std::string>{}}.encode(), cfg.timeouts.weight_sync_s, "the weight sync", [this, &failed](wire::Frame&& f) {
        const wire::SyncReply r = wire::SyncReply::decode(std::move(f));
        failed.insert(failed.end(), r.failed.begin(), r.failed.end());
        sync_seconds_on_actor = std::max(sync_seconds_on_actor, r.seconds);
        // Pushed to standalone engines, each actor rank sends its own buckets; else every rank
        // reports the whole plan.
        sync_wire_bytes = w.standalone ? sync_wire_bytes + r.wire_bytes : r.wire_bytes;
      });
    const auto idle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(kIdleWaitMs)); };
    if (!w.standalone) {
      w.engines->end_update(v, cfg.timeouts.weight_sync_s);
      link.drain(actor_group->ranks, idle);
    } else {
      link.drain(actor_group->ranks, idle);  // the pushes first: who failed leaves before End
      w.standalone->retire_failed(*w.engines, failed, v);
      w.engines->end_update(v, cfg.timeouts.weight_sync_s);
      collector->engines_changed();  // the requests of the engines that left move to the others
    }
    version = v;
  }

  void sync_weights(int64_t j) {
    dist::Watchdog::set_phase(fmt::format("weight sync, step {}", j));
    const auto t0 = w.clock->now();
    const double w0 = wall_us();
    if (!cfg.rollout.partial) {
      // The samples in flight finish with the weights they started with.
      collector->pause_dispatch(true);
      while (collector->in_flight_samples() > 0) pump();
    }
    const auto t1 = w.clock->now();
    push_weights(version + 1);
    collector->set_version(version);
    // Hybrid: the engines' caches wake at the next step's generate phase.
    if (!hybrid) collector->pause_dispatch(false);
    collector->release(Role::kActor);
    metrics["time/sync_wait_in_flight"] = std::chrono::duration<double>(t1 - t0).count();
    metrics["time/sync"] = since(t1);
    metrics["sync/seconds_on_actor"] = sync_seconds_on_actor;
    metrics["sync/wire_mb"] = sync_wire_bytes / 1e6;
    metrics["engines/count"] = static_cast<double>(w.engines->live_count());  // in the job now
    trace->span(j, "weight sync", -1, w0, wall_us());
  }

  void collect_traces(int64_t j) {
    if (!trace->any()) return;
    for (int r : trainers)
      link.call(r, wire::TraceRequest{}.encode(), cfg.timeouts.collective_s, "collecting the trace", [this, r, j](wire::Frame&& f) {
        const wire::TraceReply t = wire::TraceReply::decode(std::move(f));
        for (size_t i = 0; i < t.names.size(); ++i) trace->span(j, t.names[i], r, t.begin_us[i], t.end_us[i]);
      });
    drain(trainers);
    if (!trace->profiled(j)) return;
    trace->write();
    log::info("trace: step {} written to {}", j, trace->path());
  }

  // --- checkpoints --------------------------------------------------------------------------------

  void save() {
    if (!checkpoints.enabled()) return;
    const auto t0 = w.clock->now();
    const double w0 = wall_us();
    const std::string dir = checkpoints.begin(step);
    for (int r : trainers)
      link.call(r, wire::SaveRequest{dir}.encode(), cfg.timeouts.collective_s * 4, "the checkpoint save",
                [](wire::Frame&& f) { wire::DoneReply::decode(std::move(f)); });
    drain(trainers);
    zero::RunState st;
    st.step = step;
    st.weight_version = version;
    st.actor_updates = training->updates(Role::kActor);
    st.critic_updates = training->updates(Role::kCritic);
    st.dataset_epoch = w.prompts->cursor().epoch;
    st.dataset_position = w.prompts->cursor().position;
    st.dataset_size = std::max<int64_t>(0, w.prompts->size());  // 0: not a fixed set
    st.kl_coef = kl_ctl.value();
    st.reward_mean = reward_moments.mean();
    st.reward_m2 = reward_moments.m2();
    st.reward_count = reward_moments.count();
    st.outstanding = collector->outstanding();
    st.next_ordinal = collector->next_ordinal();
    checkpoints.commit(step, st);
    if (cfg.checkpoint.save_hf) {  // the actor as an HF directory beside its shards (the files are complete now)
      zero::export_hf(dir + "/actor", dir + "/actor_hf",
                      cfg.roles.actor.dtype == Precision::kFp32 ? at::kFloat : at::kBFloat16);
      log::info("checkpoint: step {}: the actor exported to {}/actor_hf", step, dir);
    }
    metrics["time/checkpoint"] = since(t0);
    trace->span(step, "checkpoint", -1, w0, wall_us());
    log::info("checkpoint: step {} saved in {} ({:.1f} s)", step, dir, since(t0));
    hooks.checkpoint(step, dir);
  }

  void resume() {
    const auto latest = checkpoints.latest();
    if (!latest) {
      if (w.require_resume)
        throw ConfigError(fmt::format("--resume: no complete checkpoint under checkpoint.dir = {}",
                                      checkpoints.root().empty() ? std::string("(empty)") : checkpoints.root()));
      return;
    }
    const auto& [entry, st] = *latest;
    const std::string path = entry.dir + "/controller.json";
    if (w.prompts->size() > 0 && st.dataset_size > 0 && st.dataset_size != w.prompts->size())
      throw ConfigError(fmt::format("{}: saved with a dataset of {} prompts, data.source = {} (data.prompts = {}) now "
                                    "has {}; resume with the same data",
                                    path, st.dataset_size, cfg.data.source, cfg.data.prompts, w.prompts->size()));
    for (int r : trainers)
      link.call(r, wire::LoadRequest{entry.dir}.encode(), cfg.timeouts.collective_s * 4, "loading the checkpoint",
                [](wire::Frame&& f) { wire::DoneReply::decode(std::move(f)); });
    link.drain(trainers, [] { std::this_thread::sleep_for(std::chrono::milliseconds(kIdleWaitMs)); });
    step = st.step;
    training->set_updates(st.actor_updates, st.critic_updates);
    w.prompts->seek({st.dataset_epoch, st.dataset_position});
    kl_ctl = algo::KlController(st.kl_coef, cfg.algo.target_kl, cfg.algo.kl_horizon);
    reward_moments.restore(st.reward_mean, st.reward_m2, st.reward_count);
    resend = st.outstanding;
    // A checkpoint from before the pipeline had nothing in flight: every prompt drawn was trained.
    next_ordinal = st.next_ordinal > 0 ? st.next_ordinal : step * cfg.rollout.batch_size;
    log::info("resumed from {} (step {}, weight version {}{})", entry.dir, step, st.weight_version,
              resend.empty() ? "" : fmt::format(", {} prompts in flight sent again", resend.size()));
    // The engines started from the HF model: give them the actor's trained weights.
    if (st.weight_version > 0) push_weights(st.weight_version);
  }

  // --- the loop -----------------------------------------------------------------------------------

  // Returns whether a stop was requested (then the step's checkpoint is saved).
  bool finish_step(std::unique_ptr<StepBatch> b, const OffPolicy& op) {
    const int64_t j = b->step;
    batch_metrics(*b, cfg, plan, hooks.has_after_scoring(), w.rewards.batched, metrics);
    for (const auto& [k, v] : op.metrics) metrics[k] = v;
    metrics["weight_version"] = static_cast<double>(version);
    if (b->ro.size() > 0) {
      trace->span(j, "generate", -1, wall_us_at(*w.clock, b->first_dispatch), wall_us_at(*w.clock, b->last_sample));
      trace->span(j, "score (after generation)", -1, wall_us_at(*w.clock, b->last_sample), wall_us_at(*w.clock, b->ready_at));
    }
    collect_traces(j);
    outputs->record(*b, b->train_version,
                    [this](int64_t i) { return w.prompts->at(i).line; });
    step = j;
    const bool last = step == cfg.train.num_steps;
    const bool signal = stop_requested();
    const bool saving = (cfg.checkpoint.every_steps > 0 && step % cfg.checkpoint.every_steps == 0) || last || signal;
    if (saving) save();
    evaluate(step, last);
    const double step_s = since(step_end);
    step_end = w.clock->now();
    metrics["time/step"] = step_s;
    metrics["throughput/tokens_per_s"] = step_s > 0 ? static_cast<double>(b->generated_tokens) / step_s : 0.0;
    const std::vector<engine::EngineStats> now = w.engines->stats();
    idle_metrics(step_s, cfg, plan, engine_stats, now, metrics);
    engine_stats = now;
    double busy = 0;
    for (const char* k : {"time/wait_batch", "time/advantage", "time/train", "time/sync_wait_in_flight", "time/sync",
                          "time/checkpoint", "time/eval"})
      busy += value_or(metrics, k);
    metrics["time/controller_other"] = std::max(0.0, step_s - busy);
    metrics["memory/controller_host_peak_mb"] = peak_rss_mb();
    // The run's efficiency: each phase's mean over the steps after the first (which calibrates
    // the benchmarks and warms up), or the first when it is all there is.
    for (auto it = metrics.begin(); it != metrics.end(); ++it)
      if (it.key().rfind("efficiency/", 0) == 0) {
        auto& [sum, n] = (step > first_step + 1 ? efficiency_sums : first_efficiency)[it.key()];
        sum += it.value().get<double>();
        n += 1;
      }
    if (restarts >= 0) metrics["supervisor/restarts"] = static_cast<double>(restarts);
    Metrics flat;
    for (auto it = metrics.begin(); it != metrics.end(); ++it) flat.emplace_back(it.key(), it.value().get<double>());
    const bool hook_stop = hooks.step_end(step, flat) && !last;
    for (size_t i = metrics.size(); i < flat.size(); ++i) metrics[flat[i].first] = flat[i].second;
    outputs->write(step, flat);
    if (step % cfg.logging.every_steps == 0 || last) {
      const double per_step = since(run_start) / static_cast<double>(std::max<int64_t>(1, step - first_step));
      log::info("step {}/{} | reward {:.3f} ± {:.3f} | kl {:.4f} | entropy {:.3f} | len {:.1f} | gen {:.2f}s "
                "train {:.2f}s sync {:.2f}s{}{} | {:.1f} s/step | ETA {}",
                step, cfg.train.num_steps, value_or(metrics, "reward/mean"), value_or(metrics, "reward/std"),
                value_or(metrics, "kl/mean_per_sample"), value_or(metrics, "entropy"),
                value_or(metrics, "response_length/mean"), value_or(metrics, "time/generate"),
                value_or(metrics, "time/train"), value_or(metrics, "time/sync"),
                metrics.contains("time/eval") ? fmt::format(" eval {:.2f}s", value_or(metrics, "time/eval")) : "",
                collect_cfg.staleness > 0 ? fmt::format(" lag {:.2f}", value_or(metrics, "staleness/lag_mean")) : "",
                step_s, hms(per_step * static_cast<double>(cfg.train.num_steps - step)));
    }
    last_metrics = metrics;
    collector->recycle(std::move(b));
    if (hook_stop && !saving) save();
    return signal || hook_stop;
  }

  void stop_ranks() {
    std::vector<int> ranks = trainers;
    // A hybrid engine's leader is a trainer rank: it stops once.
    for (const auto& e : plan.engines)
      if (std::find(ranks.begin(), ranks.end(), e.ranks.front()) == ranks.end()) ranks.push_back(e.ranks.front());
    double peak = peak_rss_mb();
    for (int r : ranks)
      link.call(r, wire::StopRequest{}.encode(), cfg.timeouts.collective_s, "stopping",
                [&peak](wire::Frame&& f) { peak = std::max(peak, wire::StopReply::decode(std::move(f)).peak_host_mb); });
    link.drain(ranks, [] { std::this_thread::sleep_for(std::chrono::milliseconds(kIdleWaitMs)); });
    w.channel->flush(Deadline::after_seconds(cfg.timeouts.collective_s));
    summary["host_peak_mb"] = peak;
  }

  int run() {
    if (!w.sync_plan.empty()) plan_id = w.engines->install_sync_plan(w.sync_plan);
    if (cfg.checkpoint.resume || w.require_resume) resume();
    collector =
        std::make_unique<RolloutCollector>(collect_cfg, *w.engines, link, *w.prompts, w.rewards, groups, w.loop);
    if (hybrid) collector->pause_dispatch(true);  // until the first generate phase
    collector->start(step + 1, version, resend, next_ordinal);
    run_start = step_end = w.clock->now();
    engine_stats = w.engines->stats();
    session_stats = engine_stats;
    first_step = step;
    if (w.evaluator != nullptr) {
      collector->set_side_sink(Evaluator::kRequestBase, [this](Completion& c) { w.evaluator->take(c); });
      if (step == 0 && w.evaluator->due(0, false)) {  // the starting weights: a row of step 0
        metrics = json::object();
        evaluate(0, false);
        Metrics flat;
        for (auto it = metrics.begin(); it != metrics.end(); ++it) flat.emplace_back(it.key(), it.value().get<double>());
        outputs->write(0, flat);
        run_start = step_end = w.clock->now();
      }
    }
    bool stopped_by_signal = false;
    // The watchdog's line for this rank (dist/watchdog.h): the calls it waits for. Kept when the run
    // ends on an error, which the watchdog's lines are printed after.
    struct StatusSource {
      explicit StatusSource(const wire::TrainerLink& link) {
        dist::Watchdog::set_status_source([pending = link.pending_source()] {
          const std::string p = pending();
          return p.empty() ? p : "waiting for " + p;
        });
      }
      ~StatusSource() {
        if (std::uncaught_exceptions() == 0) dist::Watchdog::set_status_source({});
      }
    } status_source(link);
    while (step < cfg.train.num_steps) {
      metrics = json::object();
      const int64_t j = step + 1;
      std::optional<dist::WaitScope> step_deadline;
      if (cfg.timeouts.step_s > 0)
        step_deadline.emplace(fmt::format("step {}", j), Deadline::after_seconds(cfg.timeouts.step_s), "timeouts.step_s");
      dist::Watchdog::set_phase(fmt::format("{}, step {}", score_after_generate ? "generate" : "generate and score", j));
      if (hybrid) hybrid_generate_phase(j);
      if (score_after_generate) {
        hybrid_score_phase(j);
        dist::Watchdog::set_phase(fmt::format("score, step {}", j));
      }
      std::unique_ptr<StepBatch> b = next_batch();
      const bool train_actor = b->step > cfg.train.critic_warmup_steps && b->ro.size() > 0;
      dist::Watchdog::set_phase(fmt::format("train, step {}", j));
      if (hybrid) hybrid_train_phase(b->step, train_actor);
      OffPolicy op;
      if (b->ro.size() > 0) {
        advantages(*b);
        op = off_policy(b->ro, off_policy_spec, b->train_version);
        train(*b, op, train_actor);
      } else {
        log::warn("step {}: no informative group to train on (rollout.filter_groups); no update", b->step);
      }
      const bool signal = finish_step(std::move(b), op);
      if (signal && step < cfg.train.num_steps) {
        stopped_by_signal = true;
        log::warn("stopping {} after step {}{}",
                  hooks.stopped_by().empty() ? std::string("on a signal")
                                             : fmt::format("as step hook '{}' asked", hooks.stopped_by()),
                  step, checkpoints.enabled() ? " (checkpoint saved)" : " (checkpoint.dir is empty: nothing saved)");
        break;
      }
    }
    collector->close();
    stop_ranks();
    if (w.tracking) w.tracking->finish(true);
    summary["event"] = stopped_by_signal ? "stopped" : "done";
    summary["steps"] = step;
    summary["seconds"] = since(run_start);
    summary["weight_version"] = version;
    if (!last_metrics.empty()) {
      summary["reward_mean"] = last_metrics.value("reward/mean", 0.0);
      summary["kl_mean_per_sample"] = last_metrics.value("kl/mean_per_sample", 0.0);
    }
    const auto all = checkpoints.list();
    summary["checkpoint"] = all.empty() ? "" : all.back().dir;
    const bool later = !efficiency_sums.empty();
    if (later || !first_efficiency.empty()) {
      std::string line;
      json eff = json::object();
      for (const auto& [key, v] : later ? efficiency_sums : first_efficiency) {
        const double mean = v.first / std::max(1, v.second);
        eff[key.substr(std::string("efficiency/").size())] = mean;
        line += fmt::format("{}{} {:.2f}", line.empty() ? "" : ", ", key.substr(11), mean);
      }
      summary["efficiency"] = eff;
      log::info("efficiency (each phase's rate over its benchmark at the job's shapes, mean of steps {}-{}): {}",
                later ? first_step + 2 : first_step + 1, step, line);
    }
    if (w.print_summary) {
      std::printf("%s\n", summary.dump().c_str());
      std::fflush(stdout);
    }
    return 0;
  }
};

Controller::Controller(const JobConfig& cfg, const ControllerWiring& wiring)
    : impl_(std::make_unique<Impl>(cfg, wiring)) {}
Controller::~Controller() = default;
int Controller::run() { return impl_->run(); }
std::string Controller::summary() const { return impl_->summary.dump(); }

}  // namespace tiller::controller
