// Moved to tiller/job/train.h (namespace tiller::job, 2026-11-29). This forwarding header keeps
// code written against the old path and names building for one release; include the new one.
#pragma once

#include "tiller/job/train.h"

namespace tiller::rollout {
using job::TrainOptions;
using job::run_train;
}  // namespace tiller::rollout
