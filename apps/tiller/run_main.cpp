#include <dlfcn.h>
#include <execinfo.h>
#include <ucontext.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "tiller/tiller.h"

namespace tiller {
namespace {

// A crash prints its signal and a backtrace (addresses resolve with addr2line -e tiller) before
// the default action: under mpirun, otherwise, only "exited on signal 11" is left of it.
void describe(const char* what, void* addr) {
  Dl_info info{};
  char line[512];
  int n;
  if (addr && dladdr(addr, &info) && info.dli_fname)
    n = std::snprintf(line, sizeof(line), "  %s %p = %s+%#lx (%s)\n", what, addr, info.dli_fname,
                      static_cast<unsigned long>(static_cast<char*>(addr) - static_cast<char*>(info.dli_fbase)),
                      info.dli_sname ? info.dli_sname : "?");
  else
    n = std::snprintf(line, sizeof(line), "  %s %p\n", what, addr);
  if (n > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(n));
}

void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  char line[160];
  const int n = std::snprintf(line, sizeof(line), "tiller: fatal signal %d (%s) in process %d at address %p; backtrace:\n",
                              sig, strsignal(sig), static_cast<int>(getpid()), info ? info->si_addr : nullptr);
  if (n > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(n));
#if defined(__x86_64__)
  // A jump to a bad address leaves no frame to unwind: its caller's return address is on the stack.
  const auto* uc = static_cast<const ucontext_t*>(context);
  void* pc = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]);
  describe("pc", pc);
  describe("return address on the stack", *reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]));
#endif
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::raise(sig);  // SA_RESETHAND: the default action now
}

void install_crash_handlers() {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc now, not inside the handler
  struct sigaction sa {};
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(sig, &sa, nullptr);
}

}  // namespace

int run_main(int argc, char** argv) {
  install_crash_handlers();
  try {
    CLI::App app{"tiller: RLHF (PPO, GRPO, RLOO, REINFORCE++) on GPU clusters"};
    app.set_version_flag("--version", std::string("tiller ") + version());
    app.require_subcommand(1);
    cli::Runner run;
    cli::add_plan_command(app, run);
    cli::add_config_command(app, run);
    cli::add_bench_command(app, run, argc, argv);
    cli::add_model_commands(app, run);
    cli::add_engine_command(app, run, argc, argv);
    cli::add_zero_commands(app, run);
    cli::add_train_command(app, run, argc, argv);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      const int code = app.exit(e);
      return code == 0 ? 0 : 2;
    }
    return run();
  } catch (const std::exception& e) {
    // One clear line; no stack of messages, no abort().
    std::fprintf(stderr, "tiller: error: %s\n", error_line(e).c_str());
    return exit_code_for(e);
  }
}

}  // namespace tiller
