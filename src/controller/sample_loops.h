// The built-in sample loops (tiller/controller/sample_loop.h), private to src/controller: the
// registry adds them through the same `add` as a user's loop.
#pragma once

#include "tiller/controller/sample_loop.h"

namespace tiller::controller {

SampleLoopDef single_turn_loop();  // sample_loops.cpp
SampleLoopDef multi_turn_loop();   // multi_turn_loop.cpp
SampleLoopDef openai_agent_loop(); // agent_loop.cpp

// A turn's answer appended to a sample's response so far (multi_turn, openai_agent): its tokens and
// log-probs, its weight-version runs continuing the sample's (tokens of another origin between
// turns belong to the run before them), its preemptions, and its finish reason and routes (a turn's
// routes cover its whole prompt, so the last turn's are the sample's). Moves the turn's routes.
void append_turn(engine::SampleOutput& sample, engine::SampleOutput& turn);

}  // namespace tiller::controller
