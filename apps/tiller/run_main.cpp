#include <dlfcn.h>
#include <execinfo.h>
#include <ucontext.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.h"
#include "tiller/core/signals.h"
#include "tiller/core/spelling.h"
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
  const char* who = process_label();
  const int n = std::snprintf(line, sizeof(line), "tiller: fatal signal %d (%s) in %s%sprocess %d at address %p; backtrace:\n",
                              sig, strsignal(sig), who, *who ? ", " : "", static_cast<int>(getpid()),
                              info ? info->si_addr : nullptr);
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

// The first word of argv that stands where a subcommand must and names none, with the nearest
// subcommand of that level: "'tarin' is not a tiller command; did you mean 'train'?". Empty when
// every word up to the first option is a subcommand.
std::string unknown_subcommand(CLI::App& app, int argc, char** argv) {
  CLI::App* level = &app;
  std::string path = "tiller";
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') return "";
    std::vector<std::string> names;
    for (const CLI::App* sub : level->get_subcommands({})) names.push_back(sub->get_name());
    if (names.empty()) return "";
    if (std::find(names.begin(), names.end(), word) != names.end()) {
      level = level->get_subcommand(word);
      path += " " + word;
      continue;
    }
    const std::string near = closest_word(word, names);
    std::string all;
    for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
    return near.empty() ? fmt::format("'{}' is not a {} command; the commands are: {}", word, path, all)
                        : fmt::format("'{}' is not a {} command; did you mean '{}'? (the commands are: {})", word,
                                      path, near, all);
  }
  return "";
}

// The first word of argv that looks like an option and that the deepest parsed command does not
// take, with the nearest of its options: "unknown option '--stpes' for 'tiller train'; its options:
// ...". Empty when there is none (the parse failed for another reason).
std::string unknown_option(CLI::App& app, int argc, char** argv) {
  CLI::App* level = &app;
  std::string path = "tiller";
  int i = 1;
  for (; i < argc; ++i) {  // the command words
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') break;
    CLI::App* sub = nullptr;
    try {
      sub = level->get_subcommand(word);
    } catch (const CLI::OptionNotFound&) {
      return "";
    }
    level = sub;
    path += " " + word;
  }
  std::vector<std::string> names;
  std::string all;
  for (const CLI::Option* o : level->get_options()) {
    for (const std::string& n : o->get_lnames()) names.push_back("--" + n);
    for (const std::string& n : o->get_snames()) names.push_back("-" + n);
    if (!o->get_lnames().empty()) all += (all.empty() ? "" : ", ") + ("--" + o->get_lnames().front());
  }
  for (; i < argc; ++i) {
    std::string word = argv[i];
    if (word.size() < 2 || word[0] != '-') continue;
    word = word.substr(0, word.find('='));
    if (std::find(names.begin(), names.end(), word) != names.end()) continue;
    const std::string near = closest_word(word, names);
    return fmt::format("unknown option '{}' for '{}'{}; its options: {}{}", word, path,
                       near.empty() ? "" : fmt::format(" (did you mean '{}'?)", near), all,
                       level->get_option_no_throw("--set") ? " (a config key goes in --set KEY=VALUE)" : "");
  }
  return "";
}

}  // namespace

int run_main(int argc, char** argv) {
  install_crash_handlers();
  // Intel MKL (libtorch's CPU BLAS) gives run-to-run identical results only in its conditional
  // numerical reproducibility mode: otherwise a GEMM may take another code path by its buffers'
  // alignment. tiller's CPU runs are meant to repeat bit for bit (algo.logprob_match bitwise,
  // resumes, the tests' equivalences). Before any MKL call; a user's own MKL_CBWR wins.
  setenv("MKL_CBWR", "AUTO", /*overwrite=*/0);
  try {
    CLI::App app{"tiller: RLHF (PPO, GRPO, RLOO, REINFORCE++) on GPU clusters"};
    app.set_version_flag("--version", std::string("tiller ") + version());
    app.require_subcommand(1);
    app.option_defaults()->always_capture_default();  // --help shows each option's default
    cli::Runner run;
    cli::add_plan_command(app, run);
    cli::add_config_command(app, run);
    cli::add_bench_command(app, run, argc, argv);
    cli::add_model_commands(app, run);
    cli::add_engine_command(app, run, argc, argv);
    cli::add_zero_commands(app, run);
    cli::add_train_command(app, run, argc, argv);
    cli::add_launch_command(app, run);
    cli::add_offline_commands(app, run, argc, argv);
    // An example under each command's --help.
    const std::pair<const char*, const char*> examples[] = {
        {"plan", "tiller plan -c configs/gpu/qwen2.5-7b-grpo-hybrid-2gpu.yaml --gpu-memory-gb 80"},
        {"config", "tiller config -c configs/quickstart.yaml --set rollout.batch_size=32"},
        {"bench", "tiller bench train --model qwen2-1.5b --seq 4096 --micro-batch 4 --steps 3"},
        {"tokenize", "tiller tokenize --tokenizer models/tiny-qwen2 --text \"Hello, world\""},
        {"generate", "tiller generate --model models/tiny-qwen2 --prompts data/quickstart/eval.jsonl --greedy "
                     "--max-new-tokens 16"},
        {"merge-lora", "tiller merge-lora --model models/base --lora out/adapter --to out/merged"},
        {"init-model", "tiller init-model --preset qwen2-0.5b --out models/qwen2-0.5b-random"},
        {"engine", "mpirun -np 2 tiller engine --model models/qwen2.5-7b --tp 2 --port 50051"},
        {"export", "tiller export --checkpoint out/quickstart/checkpoints/step_000030/actor --to out/model"},
        {"train", "mpirun --oversubscribe -np 4 tiller train -c configs/quickstart.yaml --set train.num_steps=10"},
        {"launch", "tiller launch -c configs/quickstart.yaml --max-restarts 2"},
        {"sft", "mpirun --oversubscribe -np 1 tiller sft -c configs/sft_quickstart.yaml"},
        {"train-rm", "mpirun --oversubscribe -np 1 tiller train-rm -c configs/rm_quickstart.yaml"},
        {"dpo", "mpirun --oversubscribe -np 1 tiller dpo -c configs/dpo_quickstart.yaml"},
    };
    for (const auto& [name, example] : examples)
      for (CLI::App* sub : app.get_subcommands({}))
        if (sub->get_name() == name) sub->footer(std::string("\nExample:\n  ") + example);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (const std::string what = unknown_subcommand(app, argc, argv); !what.empty()) {
        std::fprintf(stderr, "tiller: error: %s\n", what.c_str());
        return 2;
      }
      if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr)
        if (const std::string what = unknown_option(app, argc, argv); !what.empty()) {
          std::fprintf(stderr, "tiller: error: %s\n", what.c_str());
          return 2;
        }
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
