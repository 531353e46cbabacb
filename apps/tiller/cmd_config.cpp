#include <cstdio>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"

namespace tiller::cli {

void add_config_command(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("config", "Print the effective config (file + --set overrides), or the reference");
  auto path = std::make_shared<std::string>();
  auto overrides = std::make_shared<std::vector<std::string>>();
  auto reference = std::make_shared<bool>(false);
  cmd->add_option("-c,--config", *path, "Job config (YAML)");
  cmd->add_option("--set", *overrides, "Override a key: --set rollout.batch_size=512 (repeatable)");
  cmd->add_flag("--reference", *reference, "Print the reference of every key (docs/config.md)");
  cmd->callback([&run, path, overrides, reference] {
    run = [path, overrides, reference] {
      if (*reference) {
        std::fputs(config_reference_markdown().c_str(), stdout);
        return 0;
      }
      if (path->empty()) throw ConfigError("tiller config: give a config file with -c FILE (or --reference)");
      std::fputs(to_yaml(algo::load_job(*path, *overrides)).c_str(), stdout);
      return 0;
    };
  });
}

}  // namespace tiller::cli
