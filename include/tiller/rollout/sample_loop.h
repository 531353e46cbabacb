// Moved to tiller/controller/sample_loop.h (namespace tiller::controller, 2026-11-29). This
// forwarding header keeps code written against the old path and names building for one release;
// include the new one.
#pragma once

#include "tiller/controller/sample_loop.h"
#include "tiller/rollout/prompt_dataset.h"  // rollout::Prompt, for one release

namespace tiller::rollout {
using controller::FinishedSample;
using controller::LoopHost;
using controller::SampleLoop;
using controller::SampleLoopContext;
using controller::SampleLoopDef;
using controller::register_sample_loop;
using controller::find_sample_loop;
using controller::sample_loop_names;
using controller::sample_loop;
using controller::job_sample_loop;
}  // namespace tiller::rollout
