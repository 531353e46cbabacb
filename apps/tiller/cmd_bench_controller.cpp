// tiller bench controller: the controller's own cost at scale. The real Controller (collector,
// streaming packer, host arrays, typed protocol, advantages, off-policy weights, training
// dispatch, metrics) runs in one process against synthetic engines (src/testing/synthetic.h: a
// thread that produces samples of a length distribution, as fast as it can or at a set rate) and
// synthetic trainer ranks behind an in-process channel (a worker thread that decodes every frame
// and answers with numbers). What it reports:
//   generated_tokens_per_s   response tokens that went through the controller per wall second
//   controller_cpu_s_per_step  the controller thread's CPU time per step (CLOCK_THREAD_CPUTIME_ID)
//   peak_rss_mb              the process's peak resident memory (engines and trainers included)
// Shapes: A = 256 prompts x 16 samples x up to 8192 tokens (GRPO, actor + reference on 4 ranks,
// 16 engines); B = 128 engines and 64 trainer ranks (PPO: actor + reference on 32, critic on 32).
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "controller/controller.h"
#include "core/process.h"
#include "testing/synthetic.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/core/logging.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::cli {
namespace {

// The throughput the controller must sustain (issue 21's target), for the ratio.
constexpr double kTargetTokensPerSecond = 10e6;

struct ControllerBenchOptions {
  std::string shape = "A";
  int64_t prompts = 0, samples = 0, min_len = 0, max_len = 0, prompt_len = 0;
  int64_t engines = 0, actor_ranks = 0, critic_ranks = -1;
  int64_t steps = 3;
  int64_t staleness = 1;
  std::string mode = "async";
  double engine_tokens_per_s = 1e12;  // per engine; the default is as fast as the generator thread goes
  int trainer_threads = 1;
  std::string out;
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The shape's defaults for whatever the options leave at 0.
void fill_shape(ControllerBenchOptions& o) {
  auto set = [](int64_t& v, int64_t d) {
    if (v == 0) v = d;
  };
  if (o.shape == "A") {
    set(o.prompts, 256), set(o.samples, 16), set(o.min_len, 1), set(o.max_len, 8192), set(o.prompt_len, 256);
    set(o.engines, 16), set(o.actor_ranks, 4);
    if (o.critic_ranks < 0) o.critic_ranks = 0;
  } else if (o.shape == "B") {
    set(o.prompts, 256), set(o.samples, 16), set(o.min_len, 1), set(o.max_len, 2048), set(o.prompt_len, 256);
    set(o.engines, 128), set(o.actor_ranks, 32);
    if (o.critic_ranks < 0) o.critic_ranks = 32;
  } else {
    throw ConfigError(fmt::format("--shape {}: use A or B (and override any size)", o.shape));
  }
}

int run_controller_bench(ControllerBenchOptions o) {
  fill_shape(o);
  log::init(0, "bench", log::Level::kWarn);
  const std::string dir = (std::filesystem::temp_directory_path() / fmt::format("tiller-bench-controller-{}", getpid())).string();
  JobConfig cfg;
  cfg.run.output_dir = dir;
  cfg.roles.actor.model = "synthetic";
  cfg.roles.actor.gpus = o.actor_ranks;
  cfg.roles.critic.enabled = o.critic_ranks > 0;
  cfg.roles.critic.gpus = std::max<int64_t>(1, o.critic_ranks);
  cfg.algo.advantage_estimator = o.critic_ranks > 0 ? "gae" : "group_norm";
  cfg.algo.kl_in_reward = o.critic_ranks > 0;
  cfg.engines.count = o.engines;
  cfg.engines.max_num_seqs = 256;
  cfg.rollout.batch_size = o.prompts;
  cfg.rollout.n_samples_per_prompt = o.samples;
  cfg.rollout.max_new_tokens = o.max_len;
  cfg.rollout.max_prompt_tokens = o.prompt_len;
  cfg.rollout.micro_batch_tokens = 16384;
  const auto mode = parse_enum<RolloutMode>(o.mode);
  if (!mode) throw ConfigError(fmt::format("--mode {}: use sync or async", o.mode));
  cfg.rollout.mode = *mode;
  cfg.rollout.max_staleness = *mode == RolloutMode::kAsync ? o.staleness : -1;
  cfg.train.num_steps = o.steps;
  cfg.train.train_batch_size = o.prompts * o.samples / 4;  // 4 optimizer steps per step
  cfg.train.micro_batch_tokens = 16384;
  cfg.checkpoint.dir = "";
  cfg.timeouts.generate_s = 3600;
  cfg.validate();
  algo::check_config(cfg);

  dist::NodeMap nodes;
  std::vector<int> ranks(static_cast<size_t>(dist::required_world_size(cfg)));
  std::iota(ranks.begin(), ranks.end(), 0);
  nodes.nodes.push_back({"host", ranks, -1});
  const dist::RankPlan plan = dist::make_rank_plan(cfg, nodes);
  std::vector<std::unique_ptr<wire::RankEndpoint>> endpoints;
  std::vector<wire::RankEndpoint*> raw(static_cast<size_t>(plan.world_size), nullptr);
  for (const auto& a : plan.ranks) {
    if (a.rank == plan.controller) continue;
    if (!a.trainer_roles.empty())
      endpoints.push_back(std::make_unique<testing::SyntheticTrainer>(a.trainer_roles));
    else
      endpoints.push_back(std::make_unique<testing::SyntheticEngineRank>());
    raw[static_cast<size_t>(a.rank)] = endpoints.back().get();
  }
  wire::LocalChannel channel(raw, o.trainer_threads);
  testing::SyntheticEngineOptions eo;
  eo.engines = static_cast<size_t>(o.engines);
  eo.max_running = cfg.engines.max_num_seqs;
  eo.min_len = o.min_len;
  eo.max_len = o.max_len;
  eo.vocab = 32000;
  eo.tokens_per_s = o.engine_tokens_per_s;
  testing::SyntheticEngines engines(eo);
  testing::SyntheticPrompts prompts(4096, o.prompt_len, eo.vocab);
  controller::ControllerWiring w;
  w.plan = &plan;
  w.engines = &engines;
  w.channel = &channel;
  w.prompts = &prompts;
  // A rule reward over the ids (the share of even ones): the per-sample work of a rule, no decoding.
  w.rewards.rule = [](const data::Prompt&, const engine::SampleOutput& s) {
    int64_t even = 0;
    for (int64_t t : s.tokens) even += (t & 1) == 0;
    return s.tokens.empty() ? 0.0 : static_cast<double>(even) / static_cast<double>(s.tokens.size());
  };
  w.print_summary = false;

  const double cpu0 = thread_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  controller::Controller controller(cfg, w);
  controller.run();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = thread_cpu_seconds() - cpu0;

  // Per-step numbers from the controller's own metrics.
  std::vector<nlohmann::json> rows;
  {
    std::ifstream in(dir + "/metrics.jsonl");
    for (std::string l; std::getline(in, l);) rows.push_back(nlohmann::json::parse(l));
  }
  double tokens = 0, rollout_mb = 0, step_s = 0;
  for (const auto& r : rows) {
    tokens += r.value("samples", 0.0) * r.value("response_length/mean", 0.0);
    rollout_mb = std::max(rollout_mb, r.value("memory/controller_rollout_mb", 0.0));
    step_s += r.value("time/step", 0.0);
  }
  remove_tree(dir);  // not std::filesystem::remove_all: libtorch's copy crashes on the GPU host
  const double rate = tokens / wall;
  nlohmann::ordered_json j;
  j["bench"] = "controller";
  j["shape"] = o.shape;
  j["mode"] = o.mode;
  j["max_staleness"] = cfg.rollout.staleness();
  j["prompts"] = o.prompts;
  j["samples_per_prompt"] = o.samples;
  j["response_len"] = {o.min_len, o.max_len};
  j["prompt_len"] = o.prompt_len;
  j["engines"] = o.engines;
  j["trainer_ranks"] = o.actor_ranks + std::max<int64_t>(0, o.critic_ranks);
  j["steps"] = o.steps;
  j["generated_tokens"] = tokens;
  j["seconds"] = wall;
  j["seconds_per_step"] = step_s / std::max<size_t>(1, rows.size());
  j["generated_tokens_per_s"] = rate;
  j["controller_cpu_s"] = cpu;
  j["controller_cpu_s_per_step"] = cpu / static_cast<double>(o.steps);
  j["rollout_arrays_mb"] = rollout_mb;
  j["peak_rss_mb"] = peak_rss_mb();
  j["target_tokens_per_s"] = kTargetTokensPerSecond;
  j["ratio_to_target"] = rate / kTargetTokensPerSecond;
  emit_json(j.dump(), o.out);
  return 0;
}

}  // namespace

void add_bench_controller(CLI::App* bench, Runner& run) {
  auto* c = bench->add_subcommand(
      "controller", "The controller alone at scale: synthetic engines and trainer ranks in one process (JSON)");
  auto o = std::make_shared<ControllerBenchOptions>();
  c->add_option("--shape", o->shape, "A: 256 prompts x 16 samples x up to 8192 tokens; B: 128 engines, 64 trainers");
  c->add_option("--prompts", o->prompts, "Prompts per step")->check(CLI::Range(1, 1 << 20));
  c->add_option("--samples", o->samples, "Samples per prompt")->check(CLI::Range(1, 1024));
  c->add_option("--min-len", o->min_len, "Shortest response")->check(CLI::Range(1, 1 << 20));
  c->add_option("--max-len", o->max_len, "Longest response (lengths uniform in between)")->check(CLI::Range(1, 1 << 20));
  c->add_option("--prompt-len", o->prompt_len, "Prompt tokens")->check(CLI::Range(1, 1 << 20));
  c->add_option("--engines", o->engines, "Synthetic engines")->check(CLI::Range(1, 4096));
  c->add_option("--actor-ranks", o->actor_ranks, "Actor (+ reference) ranks")->check(CLI::Range(1, 4096));
  c->add_option("--critic-ranks", o->critic_ranks, "Critic ranks (0: GRPO without a critic)")
      ->check(CLI::Range(0, 4096));
  c->add_option("--steps", o->steps, "Steps")->check(CLI::Range(1, 1000));
  c->add_option("--mode", o->mode, "sync or async");
  c->add_option("--max-staleness", o->staleness, "async: rollout.max_staleness")->check(CLI::Range(0, 8));
  c->add_option("--engine-tokens-per-s", o->engine_tokens_per_s, "Each engine's token rate (default: unlimited)")
      ->check(CLI::Range(1e-3, 1e12));
  c->add_option("--trainer-threads", o->trainer_threads, "Threads answering for the trainer ranks")
      ->check(CLI::Range(1, 64));
  c->add_option("--out", o->out, "Also write the JSON here");
  c->callback([&run, o] { run = [o] { return run_controller_bench(*o); }; });
}

}  // namespace tiller::cli
