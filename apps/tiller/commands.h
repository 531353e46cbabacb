// The subcommands of `tiller`. Each registers its options on the CLI11 app and returns the
// function that runs it. Private to apps/tiller.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tiller::cli {

using Runner = std::function<int()>;

void add_plan_command(CLI::App& app, Runner& run);
void add_config_command(CLI::App& app, Runner& run);
void add_bench_command(CLI::App& app, Runner& run, int& argc, char**& argv);
void add_bench_forward(CLI::App* bench, Runner& run);
void add_model_commands(CLI::App& app, Runner& run);
void add_zero_commands(CLI::App& app, Runner& run);
void add_bench_train(CLI::App* bench, Runner& run, int& argc, char**& argv);

}  // namespace tiller::cli
