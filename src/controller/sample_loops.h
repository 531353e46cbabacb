// The built-in sample loops (tiller/rollout/sample_loop.h), private to src/controller: the
// registry adds them through the same `add` as a user's loop.
#pragma once

#include "tiller/rollout/sample_loop.h"

namespace tiller::rollout {

SampleLoopDef single_turn_loop();  // sample_loops.cpp
SampleLoopDef multi_turn_loop();   // multi_turn_loop.cpp
SampleLoopDef openai_agent_loop(); // agent_loop.cpp

}  // namespace tiller::rollout
