// Facts about this process, and the child processes tiller starts (private to src/).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace tiller {

// Peak resident memory of this process since it started, MB.
double peak_rss_mb();

// A child process (tiller launch's job, an agent harness command): `argv` run through PATH
// (posix_spawnp) in a process group of its own, with this process's environment and `env`
// (NAME=VALUE entries, each replacing the variable of its name), SIGINT and SIGTERM at their
// defaults and no signal blocked; its stdout and stderr go into one pipe, output_fd(). Throws
// ConfigError naming argv[0] when it cannot start. The destructor kills the group if the child was
// not reaped, and reaps it.
class ChildProcess {
 public:
  explicit ChildProcess(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  int output_fd() const { return out_; }
  // Sends `sig` to the child's process group.
  void signal_group(int sig) const;
  // The child's status once it exited (waitpid); false while it runs (`block`: waits for it).
  bool reap(int* status, bool block);

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  bool reaped_ = false;
};

}  // namespace tiller
