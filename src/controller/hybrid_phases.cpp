#include "controller/hybrid_phases.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "controller/engine_set.h"
#include "controller/step_trace.h"
#include "tiller/core/clock.h"
#include "tiller/core/config.h"
#include "tiller/core/logging.h"
#include "wire/channel.h"
#include "wire/messages.h"

namespace tiller::controller {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The engines' memory after a sleep or wake; returns the most any engine leader's process has
// allocated on its device then (the trainer's share included: they are one process).
double engine_memory(const std::vector<engine::ServerMemory>& mem, const std::string& phase,
                     const HybridPhases::Put& put) {
  double kv = 0, weights = 0, allocated = 0;
  for (const auto& m : mem) {
    kv = std::max(kv, static_cast<double>(m.engine.kv_cache_bytes));
    weights = std::max(weights, static_cast<double>(m.engine.weight_bytes));
    allocated = std::max(allocated, static_cast<double>(m.device_allocated));
  }
  put(fmt::format("memory/{}/engine_kv_cache_gb", phase), kv / kGiB);
  put(fmt::format("memory/{}/engine_weights_gb", phase), weights / kGiB);
  return allocated;
}

}  // namespace

HybridPhases::HybridPhases(const JobConfig& cfg, EngineSet& engines, wire::TrainerLink& link, std::vector<int> trainer_ranks,
                           StepTrace& trace)
    : cfg_(cfg), engines_(engines), link_(link), ranks_(std::move(trainer_ranks)), trace_(trace) {}

double HybridPhases::trainers(bool offload, int64_t step, const std::string& phase, const std::string& ended,
                              const Put& put) {
  std::vector<wire::PhaseReply> replies(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i)
    link_.call(ranks_[i], wire::PhaseRequest{offload}.encode(), cfg_.timeouts.collective_s,
               offload ? "offloading the trainer state" : "reloading the trainer state",
               [&replies, i](wire::Frame&& f) { replies[i] = wire::PhaseReply::decode(std::move(f)); });
  link_.drain(ranks_, [] { std::this_thread::sleep_for(std::chrono::milliseconds(1)); });
  double moved = 0, allocated = 0, reserved = 0, peak = 0;
  const double now = wall_us();
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const wire::PhaseReply& r = replies[i];
    moved += r.moved_bytes;
    allocated = std::max(allocated, r.allocated);
    reserved = std::max(reserved, r.reserved);
    peak = std::max(peak, r.peak_allocated);
    trace_.counter(step, "device memory (GiB)", ranks_[i], now,
                   {{"allocated", r.allocated / kGiB}, {"reserved", r.reserved / kGiB}});
  }
  put(fmt::format("memory/{}/allocated_gb", phase), allocated / kGiB);
  put(fmt::format("memory/{}/reserved_gb", phase), reserved / kGiB);
  put(fmt::format("memory/{}/peak_allocated_gb", ended), peak / kGiB);
  put(offload ? "hybrid/offloaded_gb" : "hybrid/reloaded_gb", moved / kGiB);
  return allocated;
}

void HybridPhases::generate(int64_t step, const Put& put) {
  const auto t0 = std::chrono::steady_clock::now();
  const double w0 = wall_us();
  const double trainer_allocated = trainers(/*offload=*/true, step, "generate", "train", put);
  // The trainers answered before the caches woke: the generate phase's footprint is the engines'.
  const double allocated = engine_memory(engines_.wake(/*weights=*/true, /*cache=*/true), "generate", put);
  put("memory/generate/allocated_gb", std::max(trainer_allocated, allocated) / kGiB);
  generating_ = true;
  asleep_ = 0;
  scored_ = false;
  sleep_seconds_ = 0;
  put("time/hybrid_wake", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  trace_.span(step, "wake engines", -1, w0, wall_us());
}

void HybridPhases::score(int64_t step, const Put& put) {
  const auto t0 = std::chrono::steady_clock::now();
  const double w0 = wall_us();
  const int level = static_cast<int>(std::min<int64_t>(cfg_.engines.sleep_level, 1));
  if (level > asleep_) {
    put("memory/score/allocated_gb", engine_memory(engines_.sleep(level), "score", put) / kGiB);
    asleep_ = level;
  }
  generating_ = false;
  scored_ = true;
  sleep_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  trace_.span(step, "sleep engines (scoring)", -1, w0, wall_us());
}

void HybridPhases::train(int64_t step, bool sync_follows, const Put& put) {
  const auto t0 = std::chrono::steady_clock::now();
  const double w0 = wall_us();
  const int level = static_cast<int>(sync_follows ? cfg_.engines.sleep_level : std::min<int64_t>(cfg_.engines.sleep_level, 1));
  if (level > asleep_) {
    engine_memory(engines_.sleep(level), "train", put);
    asleep_ = level;
  }
  generating_ = false;
  // The trainers' peak since they offloaded: their scoring's, with or without the engines beside it.
  trainers(/*offload=*/false, step, "train", scored_ ? "score" : "generate", put);
  sleep_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  put("time/hybrid_sleep", sleep_seconds_);
  trace_.span(step, "sleep engines", -1, w0, wall_us());
}

void HybridPhases::before_sync(int64_t step, const Put& put) {
  if (cfg_.engines.sleep_level < 2) return;
  const double w0 = wall_us();
  engines_.wake(/*weights=*/true, /*cache=*/false);
  trace_.span(step, "wake engine weights", -1, w0, wall_us());
  (void)put;
}

}  // namespace tiller::controller
