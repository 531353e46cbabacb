// The subcommands of `tiller`. Each registers its options on the CLI11 app and returns the
// function that runs it. Private to apps/tiller.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "tiller/core/config.h"
#include "tiller/dist/communicator.h"
#include "tiller/dist/mpi_env.h"

namespace CLI {
class App;
}

namespace tiller::cli {

using Runner = std::function<int()>;

// The job's models given as hub ids (roles.*.model, engines.model) become their snapshot folders
// in the Hugging Face cache; what a node's cache lacks is downloaded first by that node's lowest
// rank through huggingface_hub, the others waiting (timeouts.download_s), unless HF_HUB_OFFLINE is
// set (then a missing model is a ConfigError saying what to run). Collective over the world when
// the config names a hub id; nothing otherwise. hub_models.cpp.
void fetch_hub_models(JobConfig& cfg, dist::MpiEnv& env);
// One command-line model (`key`: "--model") the same way: `spec` when it is a folder, else its
// snapshot folder, downloaded first when missing (by each node's lowest rank of `env` when it has
// several ranks, else by this process).
std::string fetch_hub_model(const std::string& spec, const std::string& key, dist::MpiEnv* env = nullptr,
                            double timeout_s = 7200.0);

// A benchmark's result: one JSON line on stdout, and the same in `out` when it is not empty
// (IoError names the file when it cannot be written).
void emit_json(const std::string& text, const std::string& out);
double median(std::vector<double> v);

// --logprob-match off | bitwise of the benchmarks (generate, forward, train, score): bitwise runs
// algo.logprob_match = bitwise's batch-invariant kernels, so the mode's cost is measured beside
// the default kernels. apply_logprob_match sets the process's numerics; call it before the first
// forward.
void add_logprob_match(CLI::App* cmd, std::string& value);
void apply_logprob_match(const std::string& value);
// --experts auto | grouped | loop of the benchmarks (generate, forward, train): how a mixture of
// experts runs its experts (model/numerics.h: ExpertKernels), so the grouped GEMMs are measured
// beside the per-expert loop. apply_expert_kernels sets it; call it before the first forward.
void add_expert_kernels(CLI::App* cmd, std::string& value);
void apply_expert_kernels(const std::string& value);

// --dtype bf16 | fp16 | fp32; ConfigError otherwise.
c10::ScalarType parse_dtype(const std::string& dtype);

// The world communicator of a command (benchmarks, the engine's TP group): backend auto (NCCL
// when this build and the node have GPUs), nccl or mpi; under NCCL one GPU per rank by local
// rank. ConfigError names the cause.
struct RankComm {
  std::unique_ptr<dist::Communicator> world;
  std::unique_ptr<dist::Communicator> nccl;
  c10::Device device = c10::kCPU;
  dist::Communicator& comm() const { return nccl ? *nccl : *world; }
};
RankComm open_rank_comm(dist::MpiEnv& env, const std::string& backend, double timeout_s, const std::string& name);

void add_plan_command(CLI::App& app, Runner& run);
void add_config_command(CLI::App& app, Runner& run);
void add_bench_command(CLI::App& app, Runner& run, int& argc, char**& argv);
void add_bench_forward(CLI::App* bench, Runner& run);
void add_bench_generate(CLI::App* bench, Runner& run, int& argc, char**& argv);
void add_model_commands(CLI::App& app, Runner& run);
// The engine's shared secret: the first line of `file`, or $TILLER_ENGINE_TOKEN when `file` is
// empty ("" when neither). ConfigError names `flag` and the file.
std::string read_engine_token(const std::string& file, const char* flag);
void add_engine_command(CLI::App& app, Runner& run, int& argc, char**& argv);
void add_zero_commands(CLI::App& app, Runner& run);
void add_train_command(CLI::App& app, Runner& run, int& argc, char**& argv);
void add_launch_command(CLI::App& app, Runner& run);
void add_offline_commands(CLI::App& app, Runner& run, int& argc, char**& argv);
void add_bench_train(CLI::App* bench, Runner& run, int& argc, char**& argv);
void add_bench_sync(CLI::App* bench, Runner& run, int& argc, char**& argv);
void add_bench_push(CLI::App* bench, Runner& run, int& argc, char**& argv);
void add_bench_controller(CLI::App* bench, Runner& run);
void add_bench_tokenize(CLI::App* bench, Runner& run);
void add_bench_adamw(CLI::App* bench, Runner& run, int& argc, char**& argv);

}  // namespace tiller::cli
