#include <algorithm>
#include <cstdio>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/job/memory_plan.h"
#include "tiller/model/model_config.h"
#include "tiller/offline/offline.h"

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

// tiller plan --command sft|train-rm|dpo: roles.actor.gpus ranks, one per GPU, filling the nodes in
// order; the trained model's memory plan (offline_run.h).
int plan_offline(const JobConfig& config, const std::string& command, const std::string& path,
                 const std::vector<std::string>& overrides, const std::vector<int>& gpus, int64_t gpu_bytes) {
  const int64_t world = config.roles.actor.gpus;
  int64_t have = 0;
  for (int g : gpus) have += g;
  if (have < world)
    throw ConfigError(fmt::format("tiller {}: roles.actor.gpus = {} ranks need {} GPUs; the nodes have {}", command, world,
                                  world, have));
  std::string out = fmt::format("# {}: {} ranks, tiller {} (ZeRO-3 over all, sequence groups of {}; no controller, "
                                "no engines)\n\n rank  node  gpu  role\n",
                                path, world, command, config.roles.actor.sequence_parallel);
  std::string hostfile;
  int64_t r = 0;
  for (size_t n = 0; n < gpus.size() && r < world; ++n) {
    const int64_t here = std::min<int64_t>(gpus[n], world - r);
    for (int64_t g = 0; g < here; ++g, ++r) out += fmt::format("{:>5}  {:>4}  {:>3}  {}\n", r, n, g, command == "train-rm" ? "reward model" : "actor");
    hostfile += fmt::format("node{} slots={}\n", n, here);
  }
  const bool multi = gpus.size() > 1 && world > gpus[0];
  if (multi) out += "\nhostfile 'hosts' (replace nodeN with your host names):\n" + hostfile;
  out += fmt::format("\nlaunch:\n  mpirun -np {}{} --bind-to none {}tiller {} -c {}", world, multi ? " --hostfile hosts" : "",
                     config.cluster.device == DeviceKind::kCpu
                         ? "--oversubscribe "
                         : "-x NCCL_NVLS_ENABLE=0 -x TORCH_SYMM_MEM_DISABLE_MULTICAST=1 -x NVSHMEM_DISABLE_NVLS=1 ",
                     command, path);
  for (const std::string& kv : overrides) out += " --set " + kv;
  out += "\n";
  model::ModelConfig shape;
  try {
    shape = model::load_model_config(config.roles.actor.model);
  } catch (const std::exception&) {
    out += fmt::format("\nmemory plan: skipped, the model's config.json cannot be read here: {}\n", config.roles.actor.model);
    std::fputs(out.c_str(), stdout);
    return 0;
  }
  const job::MemoryPlan memory = offline::offline_memory_plan(config, shape, gpu_bytes, command, /*check=*/false);
  out += "\n" + memory.table();
  std::fputs(out.c_str(), stdout);
  std::fflush(stdout);
  offline::offline_memory_plan(config, shape, gpu_bytes, command, /*check=*/gpu_bytes > 0);  // exit 2 when it cannot fit
  return 0;
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
    double host_memory_gb = -1;
    std::string command = "train";
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
  cmd->add_option("--host-memory-gb", o->host_memory_gb,
                  "Host memory per node in GiB to check what optimizers on the host and hybrid offload keep there "
                  "(default: cluster.host_memory_gb)")
      ->check(CLI::Range(1.0, 1048576.0));
  cmd->add_option("--command", o->command,
                  "The command the config is for: train (default), or sft, train-rm, dpo (every rank trains roles.actor)")
      ->check(CLI::IsMember({"train", "sft", "train-rm", "dpo"}));
  cmd->callback([&run, o] {
    run = [o] {
      JobConfig config = o->command == "train" ? algo::load_job(o->config, o->overrides)
                                               : load_config(o->config, o->overrides);  // no RL-loop rules
      std::vector<int> gpus = o->node_gpus.empty() ? std::vector<int>(o->nodes, o->gpus_per_node)
                                                   : parse_node_gpus(o->node_gpus);
      if (o->host_memory_gb > 0) config.cluster.host_memory_gb = o->host_memory_gb;
      if (o->command != "train") {
        const double gb = o->gpu_memory_gb > 0 ? o->gpu_memory_gb : config.cluster.gpu_memory_gb;
        return plan_offline(config, o->command, o->config, o->overrides, gpus, static_cast<int64_t>(gb * (1ull << 30)));
      }
      const int world = dist::required_world_size(config);
      const int per_gpu = static_cast<int>(config.cluster.ranks_per_gpu);
      dist::NodeMap nodes = dist::NodeMap::fill_by_slot(gpus, world, per_gpu);
      dist::RankPlan plan = dist::make_rank_plan(config, nodes);
      auto launch = dist::mpirun_command(gpus, world, per_gpu, o->config, o->overrides,
                                         config.cluster.device == DeviceKind::kCpu);
      std::string out = fmt::format("# {}: {} ranks = {}\n\n", o->config, world, dist::world_size_breakdown(config));
      out += plan.table();
      if (!launch.hostfile.empty()) out += "\nhostfile 'hosts' (replace nodeN with your host names):\n" + launch.hostfile;
      out += "\nlaunch:\n  " + launch.command + "\n";
      // The memory plan, when the models' config.json files can be read here.
      std::string missing;
      const job::ModelShapes shapes = job::load_model_shapes(config, &missing);
      if (!missing.empty()) {
        out += fmt::format("\nmemory plan: skipped, these models' config.json cannot be read here: {}\n", missing);
        std::fputs(out.c_str(), stdout);
        return 0;
      }
      // A sample longer than the job's engines' model holds: what tiller train refuses at its start
      // (standalone engines check their own).
      if (!config.engines.standalone()) {
        const bool own_engine_model = shapes.count("engine") > 0;
        job::check_engine_context(config, shapes.at(own_engine_model ? "engine" : "actor"),
                                  own_engine_model ? config.engines.model : config.roles.actor.model);
      }
      const double gb = o->gpu_memory_gb > 0 ? o->gpu_memory_gb : config.cluster.gpu_memory_gb;
      const auto gpu_bytes = static_cast<int64_t>(gb * (1ull << 30));
      // A plan that cannot fit is an error (exit 2), naming the smallest layout that would.
      auto refuse = [&](const ConfigError& e) {
        const int per_node = *std::max_element(gpus.begin(), gpus.end());
        const auto fit = job::smallest_fitting_layout(config, shapes, per_node, gpu_bytes);
        if (!fit) throw e;
        std::string line = fmt::format("tiller plan -c {} --nodes {} --gpus-per-node {}", o->config, fit->nodes, per_node);
        auto key = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
        for (const std::string& kv : o->overrides)
          if (std::none_of(fit->overrides.begin(), fit->overrides.end(), [&](const std::string& f) { return key(f) == key(kv); }))
            line += " --set " + kv;
        for (const std::string& kv : fit->overrides) line += " --set " + kv;
        throw ConfigError(fmt::format("{}. The smallest layout that fits: {} GPUs on {} node{} of {} ({})", e.what(),
                                      fit->gpus, fit->nodes, fit->nodes > 1 ? "s" : "", per_node, line));
      };
      job::MemoryPlan memory;
      try {
        memory = job::plan_memory(config, plan, shapes, gpu_bytes);
      } catch (const ConfigError& e) {
        std::fputs(out.c_str(), stdout);  // the rank plan, before the refusal
        std::fflush(stdout);
        refuse(e);
      }
      out += "\n" + memory.table();
      std::fputs(out.c_str(), stdout);
      std::fflush(stdout);
      try {
        job::check_fits(memory, config);
      } catch (const ConfigError& e) {
        refuse(e);
      }
      return 0;
    };
  });
}

}  // namespace tiller::cli
