// tiller train: a PPO job under mpirun (job/train.h).

#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/hub.h"
#include "tiller/core/signals.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/job/train.h"

namespace tiller::cli {
namespace {

struct TrainCmdOptions {
  std::string config;
  std::vector<std::string> overrides;
  bool resume = false;
  std::string profile;
};

int run_train_cmd(const TrainCmdOptions& o, int* argc, char*** argv) {
  // SIGINT/SIGTERM go to the controller's watcher thread (job/train.h): blocked before MPI
  // (or anything else) starts a thread, so no other thread takes the default action.
  block_stop_signals();
  dist::MpiEnv env(argc, argv);
  try {
    std::vector<std::string> overrides = o.overrides;
    if (!o.profile.empty()) overrides.push_back("logging.profile_steps=" + o.profile);
    JobConfig cfg = algo::load_job(o.config, overrides);
    fetch_hub_models(cfg, env);  // hub ids: from the cache, or downloaded once per node
    job::TrainOptions to;
    to.require_resume = o.resume;
    return job::run_train(cfg, env, to);
  } catch (const std::exception& e) {
    // One line naming the rank, then the whole job ends: the other ranks may be waiting on this one.
    if (env.size() > 1) dist::MpiEnv::fail_job(env.rank(), e);
    std::fprintf(stderr, "tiller: error: rank %d: %s\n", env.rank(), error_line(e).c_str());
    return exit_code_for(e);
  }
}

}  // namespace

void add_train_command(CLI::App& app, Runner& run, int& argc, char**& argv) {
  auto* cmd = app.add_subcommand("train", "Run a PPO / GRPO job under mpirun (tiller plan prints the launch line)");
  auto o = std::make_shared<TrainCmdOptions>();
  cmd->add_option("-c,--config", o->config, "Job config (YAML)")->required();
  cmd->add_option("--set", o->overrides, "Override a key: --set rollout.batch_size=512 (repeatable)");
  cmd->add_flag("--resume", o->resume,
                "Resume from the newest checkpoint in checkpoint.dir, and fail if there is none");
  cmd->add_option("--profile", o->profile,
                  "Write a Chrome trace of every rank for these steps: 3, 3,5 or 3-5 (logging.chrome_trace)");
  cmd->callback([&run, o, &argc, &argv] { run = [o, &argc, &argv] { return run_train_cmd(*o, &argc, &argv); }; });
}

}  // namespace tiller::cli
