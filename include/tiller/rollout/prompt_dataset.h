// Moved to tiller/data/prompt_dataset.h (namespace tiller::data, 2026-11-29). This forwarding header
// keeps code written against the old path and names building for one release; include the new one.
#pragma once

#include "tiller/data/prompt_dataset.h"
#include "tiller/rollout/epoch_order.h"

namespace tiller::rollout {
using data::DatasetOptions;
using data::Prompt;
using data::PromptDataset;
}  // namespace tiller::rollout
