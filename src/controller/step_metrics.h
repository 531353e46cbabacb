// The metrics a step's batch and its timing give (private to src/controller): staleness, scoring
// rates, generation, environment and reward-service counters of the batch; the seconds each role
// and the engines were idle. docs/training.md lists them.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "controller/collector.h"
#include "tiller/engine/engine.h"

namespace tiller::dist {
struct RankPlan;
}

namespace tiller::controller {

using json = nlohmann::ordered_json;

// Staleness, scoring and rollout metrics of the batch; `hook_drops`: step hooks may drop groups
// (rollout/filtered_groups is logged); `batched`: the batch scorer whose counters are taken.
void batch_metrics(const StepBatch& b, const JobConfig& cfg, const dist::RankPlan& plan, bool hook_drops,
                   reward::BatchedReward* batched, json& metrics);

// Seconds each role and the engines were not busy during the step of `step_s` seconds (from the
// step's time/ metrics) and the generate rate per engine beside the engines' benchmark: the
// engines' counters `now` against `before` (the last step's end).
void idle_metrics(double step_s, const JobConfig& cfg, const dist::RankPlan& plan,
                  const std::vector<engine::EngineStats>& before, const std::vector<engine::EngineStats>& now,
                  json& metrics);

// The multi-turn session counters (engine/prefill_tokens, engine/session_resumes, ...): the
// engines' counters `now` against `before`, each taken when a step's batch was ready, so that the
// next step's turns (which start during the weight sync and the checkpoint save) count in it.
void session_metrics(const std::vector<engine::EngineStats>& before, const std::vector<engine::EngineStats>& now,
                     json& metrics);

}  // namespace tiller::controller
