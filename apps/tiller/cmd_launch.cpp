// tiller launch: runs `tiller train` (or with --command, `tiller sft`, `train-rm` or `dpo`) under
// mpirun (or srun) with the rank count the config needs,
// and restarts it from the newest complete checkpoint when it fails for a reason a restart can
// cure (src/job/supervisor.h).
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.h"
#include "job/supervisor.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::cli {
namespace {

struct LaunchOptions {
  std::string config, launcher = "mpirun", hostfile, command = "train";
  std::vector<std::string> overrides, launcher_args;
  int max_restarts = 3;
  double backoff_s = 10;
};

std::string this_executable() {
  char path[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) throw IoError("tiller launch: cannot find its own executable (/proc/self/exe)");
  return std::string(path, static_cast<size_t>(n));
}

// Multicast off in every launched process (NVLink SHARP can take shared GPUs down; docs/gpu.md).
constexpr const char* kNcclEnv[] = {"NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                                    "NVSHMEM_DISABLE_NVLS=1"};

std::vector<std::string> launch_line(const LaunchOptions& o, int world) {
  std::vector<std::string> cmd;
  if (o.launcher == "mpirun") {
    cmd = {"mpirun", "-np", std::to_string(world)};
    if (!o.hostfile.empty()) cmd.insert(cmd.end(), {"--hostfile", o.hostfile, "--map-by", "slot"});
    cmd.insert(cmd.end(), o.launcher_args.begin(), o.launcher_args.end());
    cmd.insert(cmd.end(), {"--bind-to", "none"});
    for (const char* e : kNcclEnv) cmd.insert(cmd.end(), {"-x", e});
    cmd.insert(cmd.end(), {"-x", "TILLER_RESTARTS"});
  } else {  // srun passes the whole environment on (--export=ALL, its default)
    for (const char* e : kNcclEnv) ::putenv(const_cast<char*>(e));
    cmd = {"srun", "-n", std::to_string(world), "--kill-on-bad-exit=1"};
    cmd.insert(cmd.end(), o.launcher_args.begin(), o.launcher_args.end());
  }
  cmd.insert(cmd.end(), {this_executable(), o.command, "-c", o.config});
  for (const auto& s : o.overrides) cmd.insert(cmd.end(), {"--set", s});
  return cmd;
}

int run_launch(const LaunchOptions& o) {
  // A config error ends here, never retried; the offline trainers skip the RL loop's rules.
  const JobConfig cfg =
      o.command == "train" ? algo::load_job(o.config, o.overrides) : load_config(o.config, o.overrides);
  job::SupervisorOptions so;
  // The offline trainers run roles.actor.gpus ranks and nothing else (tiller/offline/offline.h).
  const int world = o.command == "train" ? dist::required_world_size(cfg) : static_cast<int>(cfg.roles.actor.gpus);
  so.command = launch_line(o, world);
  so.checkpoint_dir = cfg.checkpoint.dir;
  so.max_restarts = o.max_restarts;
  so.backoff_first_s = o.backoff_s;
  so.backoff_cap_s = std::max(o.backoff_s, 300.0);
  return job::supervise(so);
}

}  // namespace

void add_launch_command(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Run `tiller train` (or sft, train-rm, dpo) under mpirun or srun, restarting it from the last checkpoint when a "
      "rank fails");
  auto o = std::make_shared<LaunchOptions>();
  cmd->add_option("-c,--config", o->config, "Job config (YAML)")->required();
  cmd->add_option("--set", o->overrides, "Override a key: --set rollout.batch_size=512 (repeatable)");
  cmd->add_option("--max-restarts", o->max_restarts,
                  "Restarts after failures a restart can cure (a rank died, a deadline expired); config and "
                  "launch errors are never retried")
      ->check(CLI::Range(0, 1000));
  cmd->add_option("--backoff", o->backoff_s, "Seconds before the first restart; doubles each time (at most 300)")
      ->check(CLI::Range(0.0, 3600.0));
  cmd->add_option("--launcher", o->launcher, "mpirun, or srun inside a Slurm allocation")
      ->check(CLI::IsMember({"mpirun", "srun"}));
  cmd->add_option("--command", o->command, "What to run: train (default), sft, train-rm or dpo")
      ->check(CLI::IsMember({"train", "sft", "train-rm", "dpo"}));
  cmd->add_option("--hostfile", o->hostfile, "mpirun: the hostfile (with --map-by slot; tiller plan shows one)");
  cmd->add_option("--launcher-arg", o->launcher_args,
                  "An argument for mpirun/srun, before the program (repeatable), e.g. --launcher-arg=--oversubscribe")
      ->allow_extra_args(false);
  cmd->callback([&run, o] { run = [o] { return run_launch(*o); }; });
}

}  // namespace tiller::cli
