// Moved to tiller/controller/packer.h (namespace tiller::controller, 2026-11-29). This forwarding
// header keeps code written against the old path and names building for one release; include the
// new one.
#pragma once

#include "tiller/controller/packer.h"

namespace tiller::rollout {
using controller::Round;
using controller::sample_cost;
using controller::plan_rounds;
using controller::StreamingPacker;
}  // namespace tiller::rollout
