// What the controller's tests share (controller_test.cpp, controller_parts_test.cpp,
// controller_turns_test.cpp): scratch directories, host-array helpers, and Job, a GRPO or PPO job
// on the synthetic stand-ins (src/testing/synthetic.h) over an in-process channel.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "../common/error_of.h"
#include "../core/faulty_file_system.h"
#include "controller/advantages.h"
#include "controller/controller.h"
#include "controller/evaluator.h"
#include "controller/job_rewards.h"
#include "controller/off_policy.h"
#include "controller/training_dispatch.h"
#include "job/supervisor.h"
#include "testing/synthetic.h"
#include "tiller/controller/sample_loop.h"
#include "tiller/controller/step_hooks.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/env/environment.h"
#include "tiller/reward/scorer_registry.h"
#include "tiller/text/tokenizer.h"
#include "zero/run_checkpoints.h"

namespace tiller::controller {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string scratch(const std::string& name) {
  const std::string d = std::string(TILLER_TEST_SCRATCH) + "/controller/" + name;
  remove_tree(d);  // libtorch's std::filesystem::remove_all crashes on the GPU host
  fs::create_directories(d);
  return d;
}

// Adds a sample with `len` response tokens to `ro`: group `g`, sample `s`, a 2-token prompt.
int64_t add_sample(Rollout& ro, int64_t g, int64_t s, int64_t len, float score) {
  std::vector<int64_t> resp(static_cast<size_t>(len), 7);
  const int64_t id = ro.add(g, s, {1, 2}, resp, std::vector<float>(static_cast<size_t>(len), -1.f), false, {}, {}, 0);
  ro.score[static_cast<size_t>(id)] = score;
  return id;
}

void expect_near(const std::vector<float>& got, const std::vector<double>& want, double tol = 1e-5) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

double metric(const Metrics& m, const std::string& key) {
  for (const auto& [k, v] : m)
    if (k == key) return v;
  ADD_FAILURE() << "no metric " << key;
  return 0;
}

// --- the controller over an in-process channel ----------------------------------------------------

// A GRPO or PPO job on the synthetic stand-ins: ranks 1.. hold the trainer roles, engines answer
// only Stop. The rule reward is the share of even ids in the response (or what `reward` says).
struct Job {
  JobConfig cfg;
  dist::RankPlan plan;
  std::vector<std::unique_ptr<wire::RankEndpoint>> endpoints;
  std::vector<testing::SyntheticTrainer*> trainers;
  std::unique_ptr<wire::LocalChannel> channel;
  std::unique_ptr<testing::SyntheticEngines> engines;
  std::unique_ptr<testing::SyntheticPrompts> prompts;
  std::function<double(const data::Prompt&, const engine::SampleOutput&)> reward;
  LoopSources loop;  // multi-turn jobs: the environment
  std::string out;
  // eval.prompts: the evaluation, its prompts tokenized with the Qwen2 fixture's tokenizer.
  std::unique_ptr<text::Tokenizer> eval_tokenizer;
  std::unique_ptr<Evaluator> evaluator;

  explicit Job(const std::string& name, bool critic = false) {
    out = scratch(name);
    cfg.roles.actor.model = "unused";
    cfg.roles.critic.enabled = critic;
    cfg.algo.advantage_estimator = critic ? "gae" : "group_norm";
    cfg.rollout.batch_size = 4;
    cfg.rollout.n_samples_per_prompt = 2;
    cfg.rollout.max_new_tokens = 64;
    cfg.rollout.micro_batch_tokens = 64;
    cfg.train.train_batch_size = 4;
    cfg.train.micro_batch_tokens = 64;
    cfg.train.num_steps = 6;
    cfg.engines.count = 2;
    cfg.engines.max_num_seqs = 4;
    cfg.run.output_dir = out;
    cfg.checkpoint.dir = "";
    cfg.logging.rollout_records = out + "/records.jsonl";
    cfg.timeouts.generate_s = 30;
    reward = [](const data::Prompt&, const engine::SampleOutput& s) {
      double even = 0;
      for (int64_t t : s.tokens) even += t % 2 == 0;
      return s.tokens.empty() ? 0.0 : even / static_cast<double>(s.tokens.size());
    };
  }

  // Validates the config and places every rank on one host.
  void make_plan() {
    cfg.validate();
    dist::NodeMap nodes;
    std::vector<int> ranks(static_cast<size_t>(dist::required_world_size(cfg)));
    std::iota(ranks.begin(), ranks.end(), 0);
    nodes.nodes.push_back({"host", ranks, -1});
    plan = dist::make_rank_plan(cfg, nodes);
  }

  // Runs the job with rank 1 (the actor's) answered by `actor` and the engines' ranks by stand-ins
  // (call make_plan() first); returns the message of the Error the run ended with, "" if none.
  std::string run_with_actor(wire::RankEndpoint& actor, const Clock* clock = nullptr) {
    testing::SyntheticEngineRank engine_rank;
    std::vector<wire::RankEndpoint*> raw(static_cast<size_t>(plan.world_size), &engine_rank);
    raw[0] = nullptr;
    raw[1] = &actor;
    wire::LocalChannel channel(raw);
    testing::SyntheticEngineOptions eo;
    eo.engines = 2;
    testing::SyntheticEngines synthetic(eo);
    testing::SyntheticPrompts source(64, 5, eo.vocab);
    ControllerWiring w;
    w.plan = &plan;
    w.engines = &synthetic;
    w.channel = &channel;
    w.prompts = &source;
    w.rewards.rule = reward;
    w.print_summary = false;
    if (clock) w.clock = clock;
    Controller c(cfg, w);
    try {
      c.run();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  // Runs the job; with `error`, a run that throws stores the message there instead of failing.
  std::string run(testing::SyntheticEngineOptions eo = {}, std::string* error = nullptr) {
    make_plan();
    std::vector<wire::RankEndpoint*> raw(static_cast<size_t>(plan.world_size), nullptr);
    for (const auto& a : plan.ranks) {
      if (a.rank == plan.controller) continue;
      if (!a.trainer_roles.empty()) {
        auto t = std::make_unique<testing::SyntheticTrainer>(a.trainer_roles);
        trainers.push_back(t.get());
        endpoints.push_back(std::move(t));
      } else {
        endpoints.push_back(std::make_unique<testing::SyntheticEngineRank>());
      }
      raw[static_cast<size_t>(a.rank)] = endpoints.back().get();
    }
    channel = std::make_unique<wire::LocalChannel>(raw);
    eo.engines = static_cast<size_t>(cfg.engine_count());
    eo.max_running = cfg.engines.max_num_seqs;
    engines = std::make_unique<testing::SyntheticEngines>(eo);
    for (auto* t : trainers) t->watch(engines.get());
    prompts = std::make_unique<testing::SyntheticPrompts>(64, 5, eo.vocab);
    ControllerWiring w;
    w.plan = &plan;
    w.engines = engines.get();
    w.channel = channel.get();
    w.prompts = prompts.get();
    w.rewards.rule = reward;
    w.loop = loop;
    w.print_summary = false;
    if (eo.clock) w.clock = eo.clock;
    if (cfg.eval.enabled()) {
      eval_tokenizer = text::load_tokenizer(std::string(TILLER_HF_FIXTURES) + "/tokenizers/qwen2");
      evaluator = std::make_unique<Evaluator>(cfg, *eval_tokenizer, *engines, std::vector<int64_t>{},
                                              eo.clock ? static_cast<const Clock&>(*eo.clock) : Clock::steady());
      w.evaluator = evaluator.get();
    }
    Controller c(cfg, w);
    if (!error) {
      EXPECT_EQ(c.run(), 0);
      return c.summary();
    }
    try {
      c.run();
    } catch (const Error& e) {
      *error = e.what();
    }
    return c.summary();
  }

  std::vector<json> lines(const std::string& file) const {
    std::vector<json> out_lines;
    std::ifstream in(out + "/" + file);
    for (std::string l; std::getline(in, l);) out_lines.push_back(json::parse(l));
    return out_lines;
  }
  std::vector<json> records(const char* event = "trained") const {
    std::vector<json> r;
    for (auto& l : lines("records.jsonl"))
      if (l["event"] == event) r.push_back(l);
    return r;
  }
  int64_t trained(Role r) const {
    int64_t n = 0;
    for (auto* t : trainers) n += t->trained_tokens(r);
    return n;
  }
};

}  // namespace
}  // namespace tiller::controller
