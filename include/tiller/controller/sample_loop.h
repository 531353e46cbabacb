// How a prompt's samples are made, by name (rollout.loop), in a registry (tiller/core/registry.h;
// docs/library.md). Built in, through the same registry:
//   single_turn  one engine request of n samples; a sample is the engine's answer.
//   multi_turn   an episode per sample with the job's environment (env.*): the engine generates a
//                turn, the environment answers, its observation is appended and the next turn
//                resumes the engine's session of the sample (docs/training.md).
//   openai_agent an agent harness per sample (agent.*; tiller/controller/agent.h) that talks to the
//                policy through an OpenAI-compatible endpoint, recorded token for token.
// A trainer of one's own registers the loop of its agent: tool calls, a judge between turns,
// several generations per sample, anything that ends in one response per sample.
//
// Who does what. The controller's collector picks the prompts, dispatches each one as a group of
// n samples to one engine, bounds the staleness, scores the samples and forms the steps. A loop
// does what happens between a group's dispatch and its samples' arrival: it sends requests to the
// group's engine (LoopHost::generate), takes their answers (SampleLoop::generated), does whatever
// else its samples need, and hands each finished sample back (LoopHost::finish) exactly once. The
// rewards are scored after that, by the job's reward.
//
// A finished sample is its prompt and every token after it, with the engine's log-prob of each
// token the model sampled (0 for the others) and the weight versions that drew them. A loop that
// puts tokens of its own into the response (observations, tool results) declares `turns`: its
// samples carry a loss mask (0 for those tokens, which are never trained) and, per model turn, its
// last token and a reward (TurnInfo, tiller/controller/experience.h).
//
// Threading: the controller's thread calls everything, and every call must return at once: work
// that takes time (an environment, a tool, a service) runs on threads of the loop's own, and its
// results are taken in poll().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tiller/controller/experience.h"
#include "tiller/core/config.h"
#include "tiller/core/registry_api.h"
#include "tiller/data/prompt_dataset.h"
#include "tiller/engine/engine.h"
#include "tiller/model/sampling_params.h"

namespace tiller::env {
class Environment;
}
namespace tiller::text {
class Tokenizer;
class ChatTemplate;
}  // namespace tiller::text

namespace tiller::controller {

// One sample as a loop hands it back.
struct FinishedSample {
  int64_t sample = 0;            // 0 .. n - 1 within its group
  std::vector<int64_t> prompt;   // its prompt; empty: the group's (the dataset's tokens)
  // Every token after the prompt; `out.logprobs` one per token (0 where the model did not sample
  // it), `out.version_starts`/`out.versions` the weight versions that drew them (the engine's
  // SampleOutput, runs continued over turns), `out.finish_reason` "length" when it was cut short.
  engine::SampleOutput out;
  TurnInfo turns;                // loops with `turns` only
  double env_seconds = 0;        // time spent in environment calls, for the step's metrics
  int64_t env_calls = 0;
  int64_t drifts = 0;            // places where a prompt did not extend the sample's tokens (openai_agent)
};

// What the collector offers a loop. A group is named by its dispatch ordinal.
class LoopHost {
 public:
  virtual ~LoopHost() = default;
  virtual int64_t samples_per_prompt() const = 0;  // n
  virtual const data::Prompt& prompt(int64_t group) const = 0;
  // The group's sampling seed: its samples draw with seed(group) + sample, so that a run with the
  // same run.seed draws the same tokens.
  virtual uint64_t seed(int64_t group) const = 0;
  // The step being formed (1-based), for the loop's logs and environments.
  virtual int64_t step() const = 0;
  // "prompt line 12, sample 3": for messages.
  virtual std::string where(int64_t group, int64_t sample) const = 0;

  // Sends `r` to the group's engine and returns its request id. `whole_group`: the group's one
  // request of n samples (sample j's answer comes back as sample j; at most once per group); else
  // r.n samples under a new id. Each answer comes back to SampleLoop::generated with the id.
  // r.params come from the job (rollout.temperature, ...) unless the loop sets them.
  virtual uint64_t generate(int64_t group, engine::Request r, bool whole_group) = 0;
  // Drops a request: its unfinished samples come back with finish_reason "abort" and are not
  // handed to the loop.
  virtual void abort(int64_t group, uint64_t request) = 0;
  // Frees an engine session a request kept (keep_session) that will not be resumed.
  virtual void release_session(int64_t group, engine::SessionKey key) = 0;
  // Sample `s.sample` of `group` is finished (once per sample).
  virtual void finish(int64_t group, FinishedSample s) = 0;
  // A resumed request reused this many tokens of its session's cache (the multi-turn metrics).
  virtual void count_session_prefix(int64_t tokens) = 0;
};

class SampleLoop {
 public:
  virtual ~SampleLoop() = default;
  // A group was dispatched: start its n samples.
  virtual void start(int64_t group) = 0;
  // One sample of a request this loop sent for `group` (finish_reason "abort" never comes here).
  virtual void generated(int64_t group, uint64_t request, engine::SampleOutput out) = 0;
  // Takes what work off the controller's thread has finished; true when anything happened.
  virtual bool poll() { return false; }
  // The group will not be trained (too stale, filtered, the run ends): abort its requests and
  // release what it holds. No sample of it may be finished afterwards.
  virtual void drop(int64_t group) = 0;
  // Samples waiting on something other than the engines (an environment's answer). A weight sync
  // that waits out the samples in flight waits for these to reach the engines too.
  virtual int64_t waiting() const { return 0; }
};

struct SampleLoopContext {
  const JobConfig* job = nullptr;  // rollout.loop_args, env.*, the limits below come from it
  LoopHost* host = nullptr;        // outlives the loop
  int64_t n = 1;                   // samples per group
  model::SamplingParams sampling;  // the job's, without a seed
  // Limits of a sample (loops with `turns`): model turns, tokens after the prompt (the model's
  // and the loop's together), and the prompt with what the loop adds before the first turn.
  int64_t max_turns = 1;
  int64_t max_response_tokens = 0;
  int64_t max_prompt_tokens = 0;
  // The job's environment (env.type; null: none), the threads and deadline of its calls.
  std::shared_ptr<env::Environment> environment;
  int env_threads = 1;
  double env_timeout_s = 60;
  std::string session_prefix = "tiller";  // environment session ids: "<prefix>-<group>-<sample>"
  // An observation's text as tokens: inside the chat template's tool turn (`turn_closed`: the
  // model's turn ended with a stop token), or `raw`, tokenized as it is.
  std::function<std::vector<int64_t>(const std::string& text, bool turn_closed, bool raw)> observation_tokens;
  // A response's text (special tokens left out).
  std::function<std::string(const std::vector<int64_t>&)> decode;
  // The actor's tokenizer and chat template (loops that render or parse text themselves).
  std::shared_ptr<const text::Tokenizer> tokenizer;
  std::shared_ptr<const text::ChatTemplate> chat;
};

struct SampleLoopDef {
  // Makes the job's loop (on the controller, once); throws ConfigError for settings it cannot use.
  std::function<std::unique_ptr<SampleLoop>(const SampleLoopContext&)> make;
  bool turns = false;              // its samples carry TurnInfo (a loss mask)
  bool needs_environment = false;  // refused without env.type
  std::string summary;             // one line
};

// A ConfigError for an invalid name, one registered already, or no factory.
// find_sample_loop: the loop registered as `name`; a ConfigError naming rollout.loop, the registered names and
// the closest one otherwise.
TILLER_REGISTRY_API(sample_loop, SampleLoopDef);
// The lookup's old name, for one release.
inline const SampleLoopDef& sample_loop(const std::string& name) { return find_sample_loop(name); }
// The job's loop name: rollout.loop, or multi_turn with an environment and single_turn without;
// its definition checked against the job (an environment where it needs one).
std::string job_sample_loop(const JobConfig& job);

}  // namespace tiller::controller
