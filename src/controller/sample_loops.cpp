#include "controller/sample_loops.h"

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/registry.h"

namespace tiller::controller {
namespace {

// single_turn: one engine request of n samples per group; a sample is the engine's answer.
class SingleTurnLoop final : public SampleLoop {
 public:
  explicit SingleTurnLoop(const SampleLoopContext& c) : host_(*c.host), n_(c.n), sampling_(c.sampling) {}

  void start(int64_t group) override {
    engine::Request r;
    r.prompt = host_.prompt(group).tokens;
    r.n = n_;
    r.params = sampling_;
    r.params.seed = host_.seed(group);
    host_.generate(group, std::move(r), /*whole_group=*/true);
  }

  void generated(int64_t group, uint64_t, engine::SampleOutput out) override {
    FinishedSample s;
    s.sample = out.sample;
    s.out = std::move(out);
    host_.finish(group, std::move(s));
  }

  void drop(int64_t group) override { host_.abort(group, static_cast<uint64_t>(group)); }

 private:
  LoopHost& host_;
  int64_t n_;
  model::SamplingParams sampling_;
};

Registry<SampleLoopDef>& loops() {
  static Registry<SampleLoopDef>* r = [] {
    auto* reg =
        new Registry<SampleLoopDef>("sample loop", [](const SampleLoopDef& d) { return d.make ? "" : "no factory (make)"; });
    reg->add("single_turn", single_turn_loop());
    reg->add("multi_turn", multi_turn_loop());
    reg->add("openai_agent", openai_agent_loop());
    return reg;
  }();
  return *r;
}

}  // namespace

SampleLoopDef single_turn_loop() {
  SampleLoopDef d;
  d.make = [](const SampleLoopContext& c) -> std::unique_ptr<SampleLoop> { return std::make_unique<SingleTurnLoop>(c); };
  d.summary = "one engine request of n samples per prompt";
  return d;
}

void append_turn(engine::SampleOutput& o, engine::SampleOutput& s) {
  const auto base = static_cast<int64_t>(o.tokens.size());
  for (size_t i = 0; i < s.versions.size(); ++i)
    if (o.versions.empty() || o.versions.back() != s.versions[i]) {
      o.version_starts.push_back(base + s.version_starts[i]);
      o.versions.push_back(s.versions[i]);
    }
  o.tokens.insert(o.tokens.end(), s.tokens.begin(), s.tokens.end());
  o.logprobs.insert(o.logprobs.end(), s.logprobs.begin(), s.logprobs.end());
  o.preemptions += s.preemptions;
  o.finish_reason = s.finish_reason;
  o.routes = std::move(s.routes);
  o.route_width = s.route_width;
}

TILLER_REGISTRY_DEFINE(sample_loop, SampleLoopDef, loops, "rollout.loop")

std::string job_sample_loop(const JobConfig& job) {
  const std::string name = !job.rollout.loop.empty() ? job.rollout.loop : job.multi_turn() ? "multi_turn" : "single_turn";
  const SampleLoopDef& def = find_sample_loop(name);
  if (def.needs_environment && !job.multi_turn())
    throw ConfigError(fmt::format("rollout.loop = {}: this loop needs an environment; set env.type (inprocess or "
                                  "remote) and env.name or env.address",
                                  name));
  if (name == "single_turn" && job.multi_turn())
    throw ConfigError(fmt::format("rollout.loop = single_turn with env.type = {}: the environment would never be "
                                  "called; use multi_turn (or leave rollout.loop unset), or set env.type = none",
                                  enum_name(job.env.type)));
  return name;
}

}  // namespace tiller::controller
