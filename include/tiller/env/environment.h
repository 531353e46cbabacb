// Environments of multi-turn rollouts (proto/tiller/env.proto has the contract): a session per
// sample; start() with the prompt, step() per model turn until done, close().
//
// Two kinds behind one interface: a service over gRPC (remote_env.h; any language, e.g. the
// Python examples in examples/envs/), and environments in-process, which library users register
// by name before the job starts:
//
//   tiller::env::register_env("my_game", [] { return std::make_unique<MyGame>(); });
//
// Threading: an Environment serves calls for different sessions from several threads at once;
// calls for one session come one at a time, in order. register_env() before the job starts;
// make_env() and names() from any thread after.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tiller/core/deadline.h"
#include "tiller/core/registry_api.h"

namespace tiller::env {

// Text (tokenized by tiller inside the chat template's tool turn) or token ids (used as they are).
struct Observation {
  std::string text;
  std::vector<int64_t> tokens;
  bool empty() const { return text.empty() && tokens.empty(); }
};

struct EpisodeStart {
  std::string session_id;        // unique within the run
  std::string prompt, label, data_source, extra_info;
  uint64_t prompt_index = 0;     // the prompt's dataset line or row (1-based)
  uint32_t sample_index = 0;
  uint64_t step = 0;
};

struct Action {
  int turn = 1;                  // 1 for the model's first turn
  std::string text;              // decoded, special tokens left out
  std::vector<int64_t> tokens;
  std::string finish_reason;     // "stop" or "length"
};

struct StepResult {
  Observation observation;       // ignored when done
  double reward = 0;             // finite
  bool done = false;
};

class Environment {
 public:
  virtual ~Environment() = default;
  // The observation to append after the prompt before the first turn (empty: none).
  virtual Observation start(const EpisodeStart& episode, Deadline deadline) = 0;
  virtual StepResult step(const std::string& session_id, const Action& action, Deadline deadline) = 0;
  virtual void close(const std::string& session_id, Deadline deadline) = 0;
  // For logs and errors: "env calculator at host:port".
  virtual std::string name() const = 0;
};

using EnvFactory = std::function<std::unique_ptr<Environment>()>;

// register_env(name, factory), find_env(name) (the factory; a ConfigError naming env.name, the
// registered names and the closest one when it is missing) and env_names() (sorted): a
// tiller::Registry (tiller/core/registry.h), names of 1 to 64 of [a-z0-9_.-], each registered once.
TILLER_REGISTRY_API(env, EnvFactory);
// A new instance of the environment registered as `name`: find_env's ConfigError, which also says
// how to register one, when there is none.
std::unique_ptr<Environment> make_env(const std::string& name);

}  // namespace tiller::env
