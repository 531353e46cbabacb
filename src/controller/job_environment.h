// What a job's sample loop is made with (private to src/controller): the environment of env.*
// (a remote service, health-checked within timeouts.startup_s, or one registered in-process) and
// the tokenizer's functions for observations and responses. Used by run_controller; the tests
// wire their own.
#pragma once

#include "controller/collector.h"

namespace tiller::text {
class Tokenizer;
}  // namespace tiller::text

namespace tiller::controller {

// `tokenizer` must outlive what this returns.
LoopSources make_job_loop_sources(const JobConfig& cfg, const text::Tokenizer& tokenizer);

}  // namespace tiller::controller
