#include <cstdio>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/rollout/memory_plan.h"

namespace tiller::cli {
namespace {

std::vector<int> parse_node_gpus(const std::string& list) {
  std::vector<int> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    try {
      std::size_t used = 0;
      int v = std::stoi(item, &used);
      if (used != item.size() || v < 1 || v > 1024) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("--node-gpus '{}': '{}' is not a GPU count in [1, 1024]; write e.g. 8,8,4", list, item));
    }
    if (out.size() > 100000) throw ConfigError(fmt::format("--node-gpus: more than 100000 nodes"));
  }
  return out;
}

}  // namespace

void add_plan_command(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("plan", "Show which rank does what for a config, and the mpirun line to launch it");
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
    int nodes = 1;
    int gpus_per_node = 8;
    std::string node_gpus;
    double gpu_memory_gb = -1;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("-c,--config", o->config, "Job config (YAML)")->required();
  cmd->add_option("--set", o->overrides, "Override a key: --set engines.tp=2 (repeatable)");
  cmd->add_option("--nodes", o->nodes, "Number of nodes")->check(CLI::Range(1, 100000));
  cmd->add_option("--gpus-per-node", o->gpus_per_node, "GPUs on each node")->check(CLI::Range(1, 1024));
  cmd->add_option("--node-gpus", o->node_gpus, "GPUs per node for uneven nodes, e.g. 8,8,4 (overrides --nodes)");
  cmd->add_option("--gpu-memory-gb", o->gpu_memory_gb,
                  "GPU memory in GiB to check the memory plan against (default: cluster.gpu_memory_gb)")
      ->check(CLI::Range(1.0, 65536.0));
  cmd->callback([&run, o] {
    run = [o] {
      JobConfig config = algo::load_job(o->config, o->overrides);
      std::vector<int> gpus = o->node_gpus.empty() ? std::vector<int>(o->nodes, o->gpus_per_node)
                                                   : parse_node_gpus(o->node_gpus);
      const int world = dist::required_world_size(config);
      const int per_gpu = static_cast<int>(config.cluster.ranks_per_gpu);
      dist::NodeMap nodes = dist::NodeMap::fill_by_slot(gpus, world, per_gpu);
      dist::RankPlan plan = dist::make_rank_plan(config, nodes);
      auto launch = dist::mpirun_command(gpus, world, per_gpu, o->config, o->overrides);
      std::string out = fmt::format("# {}: {} ranks = {}\n\n", o->config, world, dist::world_size_breakdown(config));
      out += plan.table();
      if (!launch.hostfile.empty()) out += "\nhostfile 'hosts' (replace nodeN with your host names):\n" + launch.hostfile;
      out += "\nlaunch:\n  " + launch.command + "\n";
      // The memory plan, when the models' config.json files can be read here.
      std::string missing;
      const rollout::ModelShapes shapes = rollout::load_model_shapes(config, &missing);
      if (!missing.empty()) {
        out += fmt::format("\nmemory plan: skipped, these models' config.json cannot be read here: {}\n", missing);
        std::fputs(out.c_str(), stdout);
        return 0;
      }
      const double gb = o->gpu_memory_gb > 0 ? o->gpu_memory_gb : config.cluster.gpu_memory_gb;
      const auto gpu_bytes = static_cast<int64_t>(gb * (1ull << 30));
      const rollout::MemoryPlan memory = rollout::plan_memory(config, plan, shapes, gpu_bytes);
      out += "\n" + memory.table();
      std::fputs(out.c_str(), stdout);
      std::fflush(stdout);
      rollout::check_fits(memory, config);  // a plan that cannot fit is an error (exit 2)
      return 0;
    };
  });
}

}  // namespace tiller::cli
