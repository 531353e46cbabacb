#include "core/process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "tiller/core/error.h"

extern char** environ;

namespace tiller {

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

ChildProcess::ChildProcess(const std::vector<std::string>& argv_in, const std::vector<std::string>& env_in) {
  if (argv_in.empty()) throw ConfigError("a child process needs a command");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw IoError(fmt::format("pipe: {}", std::strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  sigset_t stops;
  sigemptyset(&stops);
  sigaddset(&stops, SIGINT);
  sigaddset(&stops, SIGTERM);
  posix_spawnattr_setsigdefault(&attr, &stops);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);

  std::vector<std::string> env;
  auto replaced = [&](const char* e) {
    for (const std::string& x : env_in) {
      const size_t eq = x.find('=');
      if (eq != std::string::npos && std::strncmp(e, x.c_str(), eq + 1) == 0) return true;
    }
    return false;
  };
  for (char** e = environ; *e; ++e)
    if (!replaced(*e)) env.emplace_back(*e);
  env.insert(env.end(), env_in.begin(), env_in.end());
  std::vector<char*> envp, argv;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv_in;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  const int rc = posix_spawnp(&pid_, argv[0], &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    pid_ = -1;
    throw ConfigError(fmt::format("cannot start '{}': {}", argv_in.front(), std::strerror(rc)));
  }
  out_ = fds[0];
}

ChildProcess::~ChildProcess() {
  if (out_ >= 0) ::close(out_);
  if (pid_ > 0 && !reaped_) {
    signal_group(SIGKILL);
    int status = 0;
    reap(&status, true);
  }
}

void ChildProcess::signal_group(int sig) const {
  if (pid_ > 0 && !reaped_) ::kill(-pid_, sig);
}

bool ChildProcess::reap(int* status, bool block) {
  if (reaped_) return true;
  for (;;) {
    const pid_t w = ::waitpid(pid_, status, block ? 0 : WNOHANG);
    if (w == pid_) {
      reaped_ = true;
      return true;
    }
    if (w == 0) return false;
    if (errno == EINTR) continue;
    throw IoError(fmt::format("waitpid({}): {}", pid_, std::strerror(errno)));
  }
}

}  // namespace tiller
