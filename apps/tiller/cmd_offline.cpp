// tiller sft, train-rm, dpo: the offline trainers under mpirun (tiller/offline/offline.h).

#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/hub.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/signals.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/offline/offline.h"

namespace tiller::cli {
namespace {

struct OfflineCmdOptions {
  std::string config;
  std::vector<std::string> overrides;
  bool resume = false;
};

using OfflineMain = int (*)(const JobConfig&, dist::MpiEnv&, const offline::OfflineOptions&);

int run_offline_cmd(const OfflineCmdOptions& o, OfflineMain main, int* argc, char*** argv) {
  // SIGINT/SIGTERM: the ranks finish the step, save, and stop (blocked before any thread starts).
  block_stop_signals();
  dist::MpiEnv env(argc, argv);
  try {
    // The config's own checks; not algo::check_config, whose rules are the RL loop's.
    JobConfig cfg = load_config(o.config, o.overrides);
    fetch_hub_models(cfg, env);  // hub ids: from the cache, or downloaded once per node
    offline::OfflineOptions oo;
    oo.require_resume = o.resume;
    return main(cfg, env, oo);
  } catch (const std::exception& e) {
    // One line naming the rank, then the whole job ends: the other ranks may be waiting on this one.
    if (env.size() > 1) dist::MpiEnv::fail_job(env.rank(), e);
    std::fprintf(stderr, "tiller: error: rank %d: %s\n", env.rank(), error_line(e).c_str());
    return exit_code_for(e);
  }
}

void add_offline(CLI::App& app, Runner& run, int& argc, char**& argv, const char* name, const char* help,
                 OfflineMain main) {
  auto* cmd = app.add_subcommand(name, help);
  auto o = std::make_shared<OfflineCmdOptions>();
  cmd->add_option("-c,--config", o->config, "Job config (YAML): roles.actor, train.*, offline.*")->required();
  cmd->add_option("--set", o->overrides, "Override a key: --set offline.epochs=3 (repeatable)");
  cmd->add_flag("--resume", o->resume,
                "Resume from the newest checkpoint in checkpoint.dir, and fail if there is none");
  cmd->callback([&run, o, main, &argc, &argv] {
    run = [o, main, &argc, &argv] { return run_offline_cmd(*o, main, &argc, &argv); };
  });
}

}  // namespace

void add_offline_commands(CLI::App& app, Runner& run, int& argc, char**& argv) {
  add_offline(app, run, argc, argv, "sft",
              "Supervised fine-tuning of roles.actor on offline.data under mpirun (docs/offline.md)", offline::run_sft);
  add_offline(app, run, argc, argv, "train-rm",
              "A reward model (value head) from preference pairs in offline.data under mpirun (docs/offline.md)",
              offline::run_train_rm);
  add_offline(app, run, argc, argv, "dpo",
              "DPO of roles.actor on preference pairs in offline.data under mpirun (docs/offline.md)", offline::run_dpo);
}

}  // namespace tiller::cli
