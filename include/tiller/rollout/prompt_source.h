// Moved to tiller/controller/prompt_source.h (namespace tiller::controller, 2026-11-29). This
// forwarding header keeps code written against the old path and names building for one release;
// include the new one.
#pragma once

#include "tiller/controller/prompt_source.h"
#include "tiller/rollout/prompt_dataset.h"  // rollout::Prompt, for one release

namespace tiller::rollout {
using controller::PromptSource;
using controller::PromptSourceContext;
using controller::PromptSourceDef;
using controller::register_prompt_source;
using controller::find_prompt_source;
using controller::prompt_source_names;
using controller::prompt_source;
using controller::make_job_prompt_source;
using controller::job_dataset_options;
}  // namespace tiller::rollout
