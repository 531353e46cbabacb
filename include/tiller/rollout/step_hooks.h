// Moved to tiller/controller/step_hooks.h (namespace tiller::controller, 2026-11-29). This
// forwarding header keeps code written against the old path and names building for one release;
// include the new one.
#pragma once

#include "tiller/controller/step_hooks.h"
#include "tiller/rollout/prompt_dataset.h"  // rollout::Prompt, for one release

namespace tiller::rollout {
using controller::ScoredStep;
using controller::StepEnd;
using controller::CheckpointSaved;
using controller::StepHookDef;
using controller::register_step_hook;
using controller::find_step_hook;
using controller::step_hook_names;
using controller::step_hook;
using controller::parse_step_hooks;
}  // namespace tiller::rollout
