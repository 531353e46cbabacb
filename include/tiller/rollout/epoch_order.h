// Moved to tiller/data/epoch_order.h (namespace tiller::data, 2026-11-29). This forwarding header
// keeps code written against the old path and names building for one release; include the new one.
#pragma once

#include "tiller/data/epoch_order.h"

namespace tiller::rollout {
using data::DatasetCursor;
using data::EpochOrder;
using data::shuffled_indices;
}  // namespace tiller::rollout
