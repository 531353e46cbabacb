// Moved to tiller/controller/metrics.h (namespace tiller::controller, 2026-11-29). This forwarding
// header keeps code written against the old path and names building for one release; include the
// new one.
#pragma once

#include "tiller/controller/metrics.h"

namespace tiller::rollout {
using controller::Metrics;
using controller::TensorBoardWriter;
using controller::crc32c;
using controller::JsonlWriter;
}  // namespace tiller::rollout
