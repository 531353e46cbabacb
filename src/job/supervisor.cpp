#include "job/supervisor.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "core/process.h"
#include "tiller/core/error.h"
#include "zero/step_checkpoints.h"

namespace tiller::job {
namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

// Launcher messages that no restart cures: the ranks cannot be placed or started.
constexpr const char* kLaunchErrors[] = {
    "There are not enough slots available",     // mpirun: more ranks than slots
    "was unable to find the executable",        // mpirun
    "was unable to launch the specified application",
    "unrecognized argument",                    // mpirun usage
    "srun: error: Invalid",                     // srun usage
    "srun: error: Unable to allocate resources: Invalid",
};

// The line's text from "tiller: error:" on (launchers may prefix rank output with a tag).
std::string error_part(const std::string& line) {
  const auto at = line.find("tiller: error:");
  return at == std::string::npos ? std::string() : line.substr(at);
}

}  // namespace

Diagnosis diagnose(const RunOutcome& run) {
  if (run.exit_code == 0 && run.signal == 0) return {Verdict::kDone, "finished"};
  std::string first_error, launcher_line;
  bool launch_error = false;
  for (const std::string& line : run.tail) {
    if (first_error.empty()) first_error = error_part(line);
    for (const char* marker : kLaunchErrors)
      if (line.find(marker) != std::string::npos) {
        launch_error = true;
        if (launcher_line.empty()) launcher_line = line;
      }
    if (launcher_line.empty() && (line.find("exited on signal") != std::string::npos ||
                                  line.find("killed by signal") != std::string::npos))
      launcher_line = line;
  }
  std::string ended = run.signal ? fmt::format("the launcher was killed by signal {} ({})", run.signal,
                                               strsignal(run.signal))
                                 : fmt::format("exit code {}", run.exit_code);
  std::string cause = !first_error.empty() ? first_error : !launcher_line.empty() ? launcher_line : ended;
  if (cause != ended) cause += " (" + ended + ")";
  // Exit code 2 is tiller's for config and usage errors (tiller/core/error.h), from any rank.
  if (run.exit_code == 2 || launch_error) return {Verdict::kGiveUp, cause};
  return {Verdict::kRestart, cause};
}

double backoff_seconds(int restart, double first, double cap) {
  double s = first;
  for (int i = 1; i < restart && s < cap; ++i) s *= 2;
  return std::min(s, cap);
}

namespace {

class Run {
 public:
  // The launcher in a process group of its own: a Ctrl-C at the terminal reaches the supervisor,
  // which forwards one SIGTERM, rather than reaching the launcher twice.
  Run(const SupervisorOptions& o, int restarts) : o_(o), child_(start(o, restarts)) {}

  // Passes the output through until the launcher exits; a stop signal is forwarded once.
  RunOutcome wait(bool* stopped) {
    RunOutcome r;
    std::string partial;
    std::deque<std::string> tail;
    bool open = true, exited = false, forwarded = false;
    int status = 0;
    char buf[65536];
    while (open || !exited) {
      if (g_signal && !forwarded) {
        o_.log(fmt::format("tiller launch: {} received; asking the job to save and stop", strsignal(g_signal)));
        ::kill(child_->pid(), SIGTERM);
        forwarded = true;
        *stopped = true;
      }
      if (!exited && child_->reap(&status, false)) exited = true;
      if (!open) {
        if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      pollfd p{child_->output_fd(), POLLIN, 0};
      // Once the launcher is gone, what is left in the pipe is read; an orphan that still holds
      // it open is not waited for.
      const int ready = ::poll(&p, 1, exited ? 200 : 100);
      if (ready < 0 && errno != EINTR) break;
      if (ready <= 0) {
        if (exited) open = false;
        continue;
      }
      const ssize_t n = ::read(child_->output_fd(), buf, sizeof buf);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        open = false;
        continue;
      }
      (void)!::write(STDOUT_FILENO, buf, static_cast<size_t>(n));
      partial.append(buf, static_cast<size_t>(n));
      for (size_t nl; (nl = partial.find('\n')) != std::string::npos;) {
        tail.push_back(partial.substr(0, nl));
        partial.erase(0, nl + 1);
        if (tail.size() > o_.tail_lines) tail.pop_front();
      }
    }
    // A read error ended the loop early: the launcher's status is still needed (never a 0 by default).
    if (!exited) child_->reap(&status, true);
    if (!partial.empty()) tail.push_back(partial);
    r.tail.assign(tail.begin(), tail.end());
    if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) {
      r.signal = WTERMSIG(status);
      r.exit_code = 128 + r.signal;
    }
    return r;
  }

 private:
  static std::unique_ptr<ChildProcess> start(const SupervisorOptions& o, int restarts) {
    try {
      return std::make_unique<ChildProcess>(o.command, std::vector<std::string>{fmt::format("TILLER_RESTARTS={}", restarts)});
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("tiller launch: {}", e.what()));
    }
  }

  const SupervisorOptions& o_;
  std::unique_ptr<ChildProcess> child_;
};

// Sleeps `seconds`, or less if a stop signal arrives; true if one did.
bool sleep_unless_stopped(double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (g_signal) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return g_signal != 0;
}

}  // namespace

int supervise(const SupervisorOptions& options) {
  TILLER_CHECK(!options.command.empty(), "tiller launch: no command to run");
  SupervisorOptions o = options;
  if (!o.log)
    o.log = [](const std::string& line) {
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
    };
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  g_signal = 0;

  const zero::StepCheckpoints checkpoints(o.checkpoint_dir, 1);
  if (!checkpoints.enabled() && o.max_restarts > 0)
    o.log("tiller launch: checkpoint.dir is empty, so a restart starts the run over");
  for (int restart = 0;; ++restart) {
    for (const std::string& name : checkpoints.remove_incomplete())
      o.log(fmt::format("tiller launch: removed the incomplete checkpoint {}/{} that a crash left",
                        o.checkpoint_dir, name));
    if (restart == 0) {
      std::string line;
      for (const auto& w : o.command) line += (line.empty() ? "" : " ") + w;
      o.log("tiller launch: " + line);
    }
    bool stopped = false;
    RunOutcome run = Run(o, restart).wait(&stopped);
    const Diagnosis d = diagnose(run);
    if (stopped) {
      o.log(fmt::format("tiller launch: the job stopped on request ({}); not restarting", d.cause));
      return run.exit_code;
    }
    if (d.verdict == Verdict::kDone) {
      if (restart > 0) o.log(fmt::format("tiller launch: the job finished after {} restart(s)", restart));
      return 0;
    }
    if (d.verdict == Verdict::kGiveUp) {
      o.log(fmt::format("tiller launch: not restarting: a config or launch error, which a restart cannot cure: {}",
                        d.cause));
      return run.exit_code;
    }
    if (restart >= o.max_restarts) {
      o.log(fmt::format("tiller launch: the job failed and all {} restart(s) are used: {}", o.max_restarts, d.cause));
      return run.exit_code;
    }
    const double wait = backoff_seconds(restart + 1, o.backoff_first_s, o.backoff_cap_s);
    std::string from = "from the start";
    try {
      if (const auto latest = checkpoints.enabled() ? checkpoints.latest() : std::nullopt)
        from = fmt::format("from the checkpoint of step {}", latest->entry.step);
    } catch (const Error& e) {  // the job will say so itself, naming the file
      from = fmt::format("from the newest checkpoint ({})", e.what());
    }
    o.log(fmt::format("tiller launch: restart {}/{} in {:.0f} s, {}; cause: {}", restart + 1, o.max_restarts, wait,
                      from, d.cause));
    if (sleep_unless_stopped(wait)) {
      o.log("tiller launch: stopped while waiting to restart");
      return run.exit_code;
    }
  }
}

}  // namespace tiller::job
