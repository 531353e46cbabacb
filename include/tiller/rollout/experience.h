// Moved to tiller/controller/experience.h (namespace tiller::controller, 2026-11-29). This
// forwarding header keeps code written against the old path and names building for one release;
// include the new one.
#pragma once

#include "tiller/controller/experience.h"

namespace tiller::rollout {
using controller::RolloutLayout;
using controller::TurnInfo;
using controller::Rollout;
}  // namespace tiller::rollout
