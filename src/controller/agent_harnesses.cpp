// Agent harnesses (tiller/controller/agent.h): the registry, the Python function (FILE.py:FUNCTION,
// python/agent_harness.h), and the built-in `command` harness: agent.command run once per sample.
//
// `command`: a shell command line (/bin/sh -c), in a process group of its own, with the sample's
// endpoint and row in its environment: OPENAI_BASE_URL and OPENAI_API_KEY (so an agent that makes
// its client as `openai.OpenAI()` needs no change), TILLER_AGENT_MODEL, TILLER_AGENT_PROMPT,
// TILLER_AGENT_LABEL, TILLER_AGENT_DATA_SOURCE, TILLER_AGENT_EXTRA_INFO, TILLER_AGENT_SAMPLE,
// TILLER_AGENT_STEP, TILLER_AGENT_PROMPT_LINE and TILLER_AGENT_TIMEOUT_S. Its reward is the last
// non-empty line it prints: a number, a JSON object with "score", or nothing / "null" (the job's
// reward scores the sample). A non-zero exit fails the sample with its last lines of output; past
// its deadline its group is killed and the sample fails.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/process.h"
#include "python/agent_harness.h"
#include "tiller/controller/agent.h"
#include "tiller/core/error.h"
#include "tiller/core/registry.h"

namespace tiller::controller {
namespace {

constexpr size_t kKeptOutput = 64 << 10;  // the last bytes of a command's output kept for its reward and errors

class CommandHarness final : public AgentHarness {
 public:
  explicit CommandHarness(std::string command) : command_(std::move(command)) {}

  AgentOutcome run(const AgentTask& t, Deadline deadline) override {
    const std::vector<std::string> env = {
        "OPENAI_BASE_URL=" + t.base_url,
        "OPENAI_API_KEY=" + t.api_key,
        "TILLER_AGENT_MODEL=" + t.model,
        "TILLER_AGENT_PROMPT=" + t.prompt,
        "TILLER_AGENT_LABEL=" + t.label,
        "TILLER_AGENT_DATA_SOURCE=" + t.data_source,
        "TILLER_AGENT_EXTRA_INFO=" + t.extra_info,
        fmt::format("TILLER_AGENT_SAMPLE={}", t.sample),
        fmt::format("TILLER_AGENT_STEP={}", t.step),
        fmt::format("TILLER_AGENT_PROMPT_LINE={}", t.prompt_line),
        fmt::format("TILLER_AGENT_TIMEOUT_S={:.3f}", deadline.remaining_seconds()),
    };
    ChildProcess child({"/bin/sh", "-c", command_}, env);
    std::string out;
    char buf[16384];
    for (bool open = true; open;) {
      if (deadline.expired()) {
        child.signal_group(SIGKILL);
        throw TimeoutError(fmt::format("agent.command '{}' did not finish within agent.timeout_s", command_));
      }
      pollfd p{child.output_fd(), POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::min(200.0, deadline.remaining_seconds() * 1e3) + 1));
      if (ready < 0 && errno != EINTR) throw IoError(fmt::format("agent.command: poll: {}", std::strerror(errno)));
      if (ready <= 0) continue;
      const ssize_t n = ::read(child.output_fd(), buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        open = false;
        continue;
      }
      out.append(buf, static_cast<size_t>(n));
      if (out.size() > 2 * kKeptOutput) out.erase(0, out.size() - kKeptOutput);
    }
    // Its output closed; the command may still be running (a child that kept the pipe went away
    // first, or a process that closed it): it gets until the deadline.
    int status = 0;
    while (!child.reap(&status, false)) {
      if (deadline.expired()) {
        child.signal_group(SIGKILL);
        throw TimeoutError(fmt::format("agent.command '{}' closed its output but did not exit within agent.timeout_s",
                                       command_));
      }
      ::usleep(10000);
    }
    const std::string last = last_line(out);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      throw Error(fmt::format("agent.command '{}' {}; its last output: {}", command_,
                              WIFEXITED(status) ? fmt::format("exited with code {}", WEXITSTATUS(status))
                                                : fmt::format("was killed by signal {}", WTERMSIG(status)),
                              last.empty() ? "(none)" : last));
    return outcome(last);
  }

  std::string name() const override { return "agent.command '" + command_ + "'"; }

 private:
  static std::string last_line(const std::string& out) {
    size_t end = out.find_last_not_of(" \t\r\n");
    if (end == std::string::npos) return "";
    const size_t begin = out.rfind('\n', end);
    return out.substr(begin == std::string::npos ? 0 : begin + 1, end + 1 - (begin == std::string::npos ? 0 : begin + 1));
  }

  AgentOutcome outcome(const std::string& line) const {
    AgentOutcome o;
    if (line.empty() || line == "null" || line == "None") return o;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const nlohmann::json* v = &j;
    if (j.is_object() && j.contains("score")) v = &j.at("score");
    if (!v->is_number() || v->is_boolean() || !std::isfinite(v->get<double>()))
      throw Error(fmt::format("agent.command '{}' printed '{}' last; print the reward (a number or {{\"score\": ...}}), "
                              "or nothing to leave the sample to the job's reward",
                              command_, line.substr(0, 200)));
    o.reward = v->get<double>();
    return o;
  }

  std::string command_;
};

Registry<AgentHarnessFactory>& harnesses() {
  static auto* r = [] {
    auto* reg = new Registry<AgentHarnessFactory>("agent harness",
                                                  [](const AgentHarnessFactory& f) { return f ? "" : "no factory"; });
    reg->add("command", [](const JobConfig& job) -> std::shared_ptr<AgentHarness> {
      if (job.agent.command.empty())
        throw ConfigError("agent.harness = command needs agent.command (the shell command run for each sample)");
      return std::make_shared<CommandHarness>(job.agent.command);
    });
    return reg;
  }();
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(agent_harness, AgentHarnessFactory, harnesses, "agent.harness")

std::shared_ptr<AgentHarness> make_agent_harness(const JobConfig& job) {
  const std::string& spec = job.agent.harness;
  const size_t colon = spec.rfind(':');
  const std::string file = colon == std::string::npos ? spec : spec.substr(0, colon);
  if (file.size() > 3 && file.compare(file.size() - 3, 3, ".py") == 0) return python::python_agent_harness(spec);
  std::shared_ptr<AgentHarness> h = find_agent_harness(spec)(job);
  if (!h) throw ConfigError(fmt::format("agent.harness = '{}': its factory made no harness", spec));
  return h;
}

}  // namespace tiller::controller
