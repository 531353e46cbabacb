// Agent harnesses for the openai_agent sample loop (docs/agents.md). A harness is the user's agent:
// code that talks to the policy through an OpenAI-compatible API (the `openai` client's
// chat.completions / completions), calls its tools, and returns the sample's reward (or leaves it
// to the job's reward). The loop runs one harness call per sample, with a base URL of the sample's
// own (http://HOST:PORT/agents/<key>/v1); every request under it lands on the sample's engine,
// resumes its cached session, and is recorded token for token: the sample's trajectory is what
// the engine sampled, with the harness's own text between the turns masked out of the loss.
//
// Built in: FILE.py:FUNCTION (agent.harness), a Python function run by the embedded interpreter.
// A trainer of one's own registers C++ harnesses by name.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tiller/core/config.h"
#include "tiller/core/deadline.h"
#include "tiller/core/registry_api.h"

namespace tiller::controller {

// What a harness call gets: where to send its requests, and the sample's dataset row.
struct AgentTask {
  std::string base_url;   // the openai client's base_url for this sample (ends in /v1)
  std::string api_key;    // the endpoint's key (Authorization: Bearer <key>)
  std::string model;      // the served model name
  std::string prompt;     // the dataset's prompt (Prompt::input: before the chat template)
  std::string label;      // the dataset's label (its JSON text when label_is_json)
  bool label_is_json = false;
  std::string data_source;
  std::string extra_info;  // JSON text; "" when none
  int64_t prompt_line = 0;  // 1-based line of the prompt in its file
  int64_t sample = 0;       // 0 .. n - 1 within its group
  int64_t step = 0;         // the step being formed
};

// What a harness call returns: the sample's reward, or none (the job's reward scores the sample).
struct AgentOutcome {
  std::optional<double> reward;
};

// Thread-safe: the loop calls run() from agent.concurrency threads at once.
class AgentHarness {
 public:
  virtual ~AgentHarness() = default;
  // Runs the agent on one sample until it is done. Throws (any std::exception) to fail the sample:
  // the job ends with the message, naming the sample. `deadline`: agent.timeout_s from the start.
  virtual AgentOutcome run(const AgentTask& task, Deadline deadline) = 0;
  virtual std::string name() const = 0;  // for messages: "examples/agents/calculator.py:run"
};

using AgentHarnessFactory = std::function<std::shared_ptr<AgentHarness>(const JobConfig& job)>;
// A ConfigError for an invalid name, one registered already, or no factory.
// find_agent_harness: the harness factory registered as `name`; a ConfigError naming agent.harness, the registered names and
// the closest one otherwise.
TILLER_REGISTRY_API(agent_harness, AgentHarnessFactory);
// agent.harness made: a Python FILE.py:FUNCTION, or a registered name (find_agent_harness).
std::shared_ptr<AgentHarness> make_agent_harness(const JobConfig& job);

}  // namespace tiller::controller
