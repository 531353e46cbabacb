// tiller: the public API in one include.
//
// A trainer that links tiller::tiller can run the same launcher as the `tiller` binary, after
// registering its own pieces:
//   int main(int argc, char** argv) { return tiller::run_main(argc, argv); }
//
// How a job runs, header by header (config, plan, models, engines, sync, controller, trainers):
// include/README.md in the source tree.
#pragma once

#include "tiller/algo/advantage_estimator.h"
#include "tiller/algo/algo.h"
#include "tiller/controller/agent.h"
#include "tiller/controller/prompt_source.h"
#include "tiller/controller/sample_loop.h"
#include "tiller/controller/step_hooks.h"
#include "tiller/core/config.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/core/registry.h"
#include "tiller/dist/communicator.h"
#include "tiller/dist/groups.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/job/train.h"
#include "tiller/reward/rule_reward.h"
#include "tiller/reward/scorer_registry.h"

namespace tiller {

// The `tiller` command line (plan, config, bench, ...). Any exception becomes one line on
// stderr and a non-zero exit code (2 for config and usage errors).
int run_main(int argc, char** argv);

inline const char* version() { return "0.1.0"; }

}  // namespace tiller
