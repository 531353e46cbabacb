// Moved to tiller/job/memory_plan.h (namespace tiller::job, 2026-11-29). This forwarding header
// keeps code written against the old path and names building for one release; include the new one.
#pragma once

#include "tiller/job/memory_plan.h"

namespace tiller::rollout {
using job::kReserveBytes;
using job::kAllocatorSlackDivisor;
using job::reserve_bytes;
using job::Phase;
using job::phase_name;
using job::PhaseMemory;
using job::RankMemory;
using job::MemoryPlan;
using job::ModelShapes;
using job::train_activation_bytes;
using job::recompute_order;
using job::recompute_from_order;
using job::activations_fit;
using job::plan_memory;
using job::check_fits;
using job::LayoutSuggestion;
using job::kMaxSuggestedRanks;
using job::kMaxSuggestedScale;
using job::smallest_fitting_layout;
using job::plan_trainer;
using job::check_trainer_fits;
using job::load_model_shapes;
}  // namespace tiller::rollout
