#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "tiller/tiller.h"

namespace tiller {

int run_main(int argc, char** argv) {
  try {
    CLI::App app{"tiller: RLHF (PPO, GRPO, RLOO, REINFORCE++) on GPU clusters"};
    app.set_version_flag("--version", std::string("tiller ") + version());
    app.require_subcommand(1);
    cli::Runner run;
    cli::add_plan_command(app, run);
    cli::add_config_command(app, run);
    cli::add_bench_command(app, run, argc, argv);
    cli::add_model_commands(app, run);
    cli::add_engine_command(app, run, argc, argv);
    cli::add_zero_commands(app, run);
    cli::add_train_command(app, run, argc, argv);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      const int code = app.exit(e);
      return code == 0 ? 0 : 2;
    }
    return run();
  } catch (const std::exception& e) {
    // One clear line; no stack of messages, no abort().
    std::fprintf(stderr, "tiller: error: %s\n", e.what());
    return exit_code_for(e);
  }
}

}  // namespace tiller
