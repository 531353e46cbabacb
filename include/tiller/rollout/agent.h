// Moved to tiller/controller/agent.h (namespace tiller::controller, 2026-11-29). This forwarding
// header keeps code written against the old path and names building for one release; include the
// new one.
#pragma once

#include "tiller/controller/agent.h"

namespace tiller::rollout {
using controller::AgentTask;
using controller::AgentOutcome;
using controller::AgentHarness;
using controller::AgentHarnessFactory;
using controller::register_agent_harness;
using controller::find_agent_harness;
using controller::agent_harness_names;
using controller::make_agent_harness;
}  // namespace tiller::rollout
