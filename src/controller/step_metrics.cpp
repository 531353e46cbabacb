#include "controller/step_metrics.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "tiller/core/config.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/reward/batched_reward.h"

namespace tiller::controller {
namespace {

double value_or(const json& j, const char* key, double fallback = 0) {
  return j.contains(key) ? j[key].get<double>() : fallback;
}

}  // namespace

void batch_metrics(const StepBatch& b, const JobConfig& cfg, const dist::RankPlan& plan, bool hook_drops,
                   reward::BatchedReward* batched, json& metrics) {
  const uint64_t v = b.train_version;
  std::vector<double> lags(static_cast<size_t>(cfg.rollout.staleness()) + 1, 0.0);
  double lag_sum = 0, lag_max = 0, spanning = 0;
  for (int64_t s = 0; s < b.ro.size(); ++s) {
    const uint64_t oldest = b.ro.oldest_version(s);
    const double lag = v > oldest ? static_cast<double>(v - oldest) : 0.0;
    lags[std::min(lags.size() - 1, static_cast<size_t>(lag))] += 1;
    lag_sum += lag;
    lag_max = std::max(lag_max, lag);
    if (b.ro.run_offset[s + 1] - b.ro.run_offset[s] > 1) spanning += 1;
  }
  const double n = std::max<double>(1, static_cast<double>(b.ro.size()));
  for (size_t i = 0; i < lags.size(); ++i) metrics[fmt::format("staleness/lag_{}", i)] = lags[i];
  metrics["staleness/lag_mean"] = lag_sum / n;
  metrics["staleness/lag_max"] = lag_max;
  metrics["staleness/multi_version_samples"] = spanning;
  metrics["rollout/groups"] = static_cast<double>(b.groups.size());
  metrics["rollout/stale_dropped_groups"] = static_cast<double>(b.stale_dropped_groups);
  metrics["rollout/stale_dropped_samples"] = static_cast<double>(b.stale_dropped_samples);
  if (cfg.rollout.filter_groups || hook_drops)
    metrics["rollout/filtered_groups"] = static_cast<double>(b.filtered_groups);  // with the hooks' drops
  if (cfg.rollout.filter_groups) metrics["rollout/filter_cap_reached"] = b.filter_cap_reached ? 1.0 : 0.0;
  metrics["entropy"] = b.scores.entropy_tokens > 0 ? b.scores.entropy_sum / b.scores.entropy_tokens : 0.0;
  for (Role r : kRoles) {
    if (!plan.group(r)) continue;
    const double s = b.scores.seconds[role_index(r)];
    metrics["time/score." + std::string(role_name(r))] = s;
    // One rank's scoring rate: comparable with `tiller bench forward` on the same shape.
    const double rate = s > 0 ? static_cast<double>(b.scores.tokens[role_index(r)]) / s : 0.0;
    metrics["throughput/score_tokens_per_s." + std::string(role_name(r))] = rate;
    // Beside the rank's scoring benchmark at the job's shapes (logging.efficiency).
    if (const double bench = b.scores.bench[role_index(r)]; bench > 0 && s > 0) {
      metrics["throughput/score_bench_tokens_per_s." + std::string(role_name(r))] = bench;
      metrics["efficiency/score." + std::string(role_name(r))] = rate / bench;
    }
  }
  const bool sampled = b.first_dispatch != SteadyClock::time_point::max() && b.ro.size() > 0;
  const double gen = sampled ? std::chrono::duration<double>(b.last_sample - b.first_dispatch).count() : 0.0;
  metrics["time/generate"] = gen;
  metrics["time/score_tail"] = sampled ? std::chrono::duration<double>(b.ready_at - b.last_sample).count() : 0.0;
  metrics["throughput/generate_tokens_per_s"] = gen > 0 ? static_cast<double>(b.generated_tokens) / gen : 0.0;
  metrics["samples"] = static_cast<double>(b.ro.size());
  if (cfg.multi_turn()) {
    metrics["env/seconds_per_sample"] = b.ro.size() > 0 ? b.env_seconds / static_cast<double>(b.ro.size()) : 0.0;
    metrics["env/calls"] = static_cast<double>(b.env_calls);
    metrics["env/session_prefix_tokens"] = static_cast<double>(b.session_prefix_tokens);
    if (cfg.agent_loop()) metrics["agent/drifts"] = static_cast<double>(b.drifts);
  }
  metrics["memory/controller_rollout_mb"] = static_cast<double>(b.ro.bytes()) / 1e6;
  if (batched) {
    const reward::RewardStats rs = batched->take_stats();
    const std::string kind = batched->scorer().kind();
    metrics["reward/" + kind + "_calls"] = rs.calls;
    if (kind == "remote") metrics["reward/remote_retries"] = rs.retries;
    metrics["reward/" + kind + "_seconds_per_call"] =
        rs.calls > 0 ? rs.call_seconds / static_cast<double>(rs.calls) : 0.0;
    for (const auto& [name, v] : rs.extras)
      if (v.second > 0) metrics["reward/extra/" + name] = v.first / static_cast<double>(v.second);
  }
}

void idle_metrics(double step_s, const JobConfig& cfg, const dist::RankPlan& plan,
                  const std::vector<engine::EngineStats>& before, const std::vector<engine::EngineStats>& now,
                  json& metrics) {
  const auto busy = [&](Role r, double per_rank) {
    return per_rank + value_or(metrics, ("time/train." + std::string(role_name(r))).c_str());
  };
  for (const auto& g : plan.groups) {
    const double ranks = static_cast<double>(g.ranks.size());
    double b = busy(g.role, value_or(metrics, ("time/score." + std::string(role_name(g.role))).c_str()) / ranks);
    if (g.role == Role::kActor) b += value_or(metrics, "sync/seconds_on_actor");
    metrics["idle/" + std::string(role_name(g.role))] = std::max(0.0, step_s - b);
  }
  // The generate phase's rate per engine beside the engines' benchmark at the job's shapes.
  if (!now.empty()) {
    double bench = 0, measured = 0;
    for (const auto& e : now)
      if (e.bench_tokens_per_s > 0) {
        bench += e.bench_tokens_per_s;
        measured += 1;
      }
    const double per_engine = value_or(metrics, "throughput/generate_tokens_per_s") / static_cast<double>(now.size());
    metrics["throughput/generate_tokens_per_s_per_engine"] = per_engine;
    if (measured > 0 && per_engine > 0) {
      metrics["throughput/generate_bench_tokens_per_s"] = bench / measured;
      metrics["efficiency/generate"] = per_engine / (bench / measured);
    }
  }
  // Separate pools: the engines' GPUs (in a hybrid job the trainers' phases report the shared device).
  if (!cfg.cluster.hybrid) {
    double peak = 0;
    for (const auto& e : now) peak = std::max(peak, e.device_peak_gb);
    if (peak > 0) metrics["memory/engine_device_peak_gb"] = peak;
  }
  if (!now.empty() && now.size() == before.size()) {
    double sum = 0;
    for (size_t i = 0; i < now.size(); ++i) sum += now[i].seconds_in_steps - before[i].seconds_in_steps;
    metrics["idle/engines"] = std::max(0.0, step_s - sum / static_cast<double>(now.size()));
  }
}

void session_metrics(const std::vector<engine::EngineStats>& before, const std::vector<engine::EngineStats>& now,
                     json& metrics) {
  if (now.empty() || now.size() != before.size()) return;
  // What the engines computed again and what the sessions spared them, this step.
  double prefill = 0, resumes = 0, reused = 0, misses = 0, evictions = 0, preemptions = 0;
  for (size_t i = 0; i < now.size(); ++i) {
    preemptions += static_cast<double>(now[i].preemptions - before[i].preemptions +
                                       now[i].kv_rebuilds - before[i].kv_rebuilds);
    prefill += static_cast<double>(now[i].prefill_tokens - before[i].prefill_tokens);
    resumes += static_cast<double>(now[i].session_resumes - before[i].session_resumes);
    reused += static_cast<double>(now[i].session_tokens_reused - before[i].session_tokens_reused);
    misses += static_cast<double>(now[i].session_misses - before[i].session_misses);
    evictions += static_cast<double>(now[i].session_evictions - before[i].session_evictions);
  }
  metrics["engine/prefill_tokens"] = prefill;
  metrics["engine/session_resumes"] = resumes;
  metrics["engine/session_tokens_reused"] = reused;
  metrics["engine/session_misses"] = misses;
  metrics["engine/session_evictions"] = evictions;
  metrics["engine/recomputed_sequences"] = preemptions;  // preempted, or rebuilt after a weight update
}

}  // namespace tiller::controller
