// Environments: the in-process registry, and the gRPC client against the example Python services
// (examples/envs/env_server.py) on real sockets: episodes of both example environments, replayed
// steps, retries, deadlines and the errors that name the call.
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "../common/error_of.h"
#include "../model/fixtures.h"
#include "tiller/core/error.h"
#include "tiller/env/environment.h"
#include "tiller/env/remote_env.h"

namespace tiller::env {
namespace {

class Counter final : public Environment {
 public:
  Observation start(const EpisodeStart& e, Deadline) override { return {"count from " + e.label, {}}; }
  StepResult step(const std::string&, const Action& a, Deadline) override {
    return {{std::to_string(a.turn), {}}, 0.5, a.turn >= 2};
  }
  void close(const std::string&, Deadline) override {}
  std::string name() const override { return "env counter (in-process)"; }
};

TEST(EnvRegistry, InProcessEnvironmentsByName) {
  register_env("test_counter", [] { return std::make_unique<Counter>(); });
  EXPECT_THROW(register_env("test_counter", [] { return std::make_unique<Counter>(); }), ConfigError);
  EXPECT_THROW(register_env("", [] { return std::make_unique<Counter>(); }), ConfigError);
  EXPECT_THROW(register_env("test_nothing", EnvFactory()), ConfigError);
  EXPECT_NE(find_env("test_counter")(), nullptr);
  auto e = make_env("test_counter");
  EpisodeStart s;
  s.label = "3";
  EXPECT_EQ(e->start(s, Deadline::after_seconds(1)).text, "count from 3");
  EXPECT_TRUE(e->step("x", Action{2, "", {}, "stop"}, Deadline::after_seconds(1)).done);
  try {
    make_env("no_such_env");
    FAIL() << "an unknown environment was made";
  } catch (const ConfigError& err) {
    const std::string what = err.what();
    EXPECT_NE(what.find("env.name = 'no_such_env': not a registered in-process environment (registered: "
                        "test_counter)"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("register it with tiller::env::register_env"), std::string::npos) << what;
  }
}

// The example server as a child process, stopped with SIGTERM at the end of the test.
class Server {
 public:
  explicit Server(const std::vector<std::string>& flags) {
    const std::string dir = test::scratch_dir() + "/env";
    std::filesystem::create_directories(dir);
    port_file_ = dir + "/port." + std::to_string(::getpid()) + "." + std::to_string(counter_++);
    std::filesystem::remove(port_file_);
    std::vector<std::string> args{TILLER_TEST_PYTHON_INTERPRETER,
                                  std::string(TILLER_SOURCE_DIR) + "/examples/envs/env_server.py", "--port", "0",
                                  "--port-file", port_file_};
    args.insert(args.end(), flags.begin(), flags.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      std::_Exit(127);
    }
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(port_file_) && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::ifstream in(port_file_);
    int port = 0;
    in >> port;
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  ~Server() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  bool up() const { return address_ != "127.0.0.1:0"; }
  const std::string& address() const { return address_; }

 private:
  static inline int counter_ = 0;
  pid_t pid_ = -1;
  std::string port_file_, address_;
};

bool python_has_grpc() {
  const std::string cmd = std::string(TILLER_TEST_PYTHON_INTERPRETER) + " -c 'import grpc, grpc_tools' 2>/dev/null";
  return std::system(cmd.c_str()) == 0;
}

RemoteEnvOptions options(const std::string& address, int retries = 3, double timeout = 30) {
  RemoteEnvOptions o;
  o.address = address;
  o.retries = retries;
  o.timeout_seconds = timeout;
  o.backoff_seconds = 0.05;
  return o;
}

Action act(int turn, const std::string& text) { return Action{turn, text, {}, "stop"}; }

TEST(RemoteEnv, CalculatorAndGuessingGameEpisodesOverRealSockets) {
  if (!python_has_grpc()) GTEST_SKIP() << "the test Python has no grpcio/grpcio-tools (scripts/setup.sh installs them)";
  const Deadline d = Deadline::after_seconds(60);
  {
    Server s({"--env", "calculator"});
    ASSERT_TRUE(s.up()) << "the calculator environment did not start";
    RemoteEnvironment env(options(s.address()));
    EXPECT_EQ(env.check_health(d), "calculator");
    EpisodeStart e;
    e.session_id = "s1";
    e.prompt = "Ann has 12 boxes of 7 pens. How many pens?";
    e.label = "84";
    EXPECT_NE(env.start(e, d).text.find("<calc>"), std::string::npos);
    StepResult r = env.step("s1", act(1, "Let me compute <calc>12 * (3 + 4)</calc>"), d);
    EXPECT_EQ(r.observation.text, "<result>84</result>");
    EXPECT_FALSE(r.done);
    EXPECT_EQ(r.reward, 0.0);
    // A repeated turn (a retry) answers what it answered before, whatever the text.
    EXPECT_EQ(env.step("s1", act(1, "<calc>1/0</calc>"), d).observation.text, "<result>84</result>");
    EXPECT_EQ(env.step("s1", act(2, "<calc>1/0</calc>"), d).observation.text, "<error>division by zero</error>");
    r = env.step("s1", act(3, "So <answer>84</answer>"), d);
    EXPECT_TRUE(r.done);
    EXPECT_EQ(r.reward, 1.0);
    env.close("s1", d);
    env.close("s1", d);  // idempotent
    e.session_id = "s2";
    env.start(e, d);
    EXPECT_EQ(env.step("s2", act(1, "<answer>85</answer>"), d).reward, 0.0);
    const std::string gone = error_of([&] { env.step("nope", act(4, "x"), d); });
    EXPECT_NE(gone.find("environment " + s.address() + ": Step of session nope, turn 4 failed after 1 attempt(s): "
                        "no session 'nope': Start it first (NOT_FOUND)"),
              std::string::npos)
        << gone;
  }
  Server s({"--env", "guess"});
  ASSERT_TRUE(s.up());
  RemoteEnvironment env(options(s.address()));
  EpisodeStart e;
  e.session_id = "g";
  e.label = "42";
  EXPECT_EQ(env.start(e, d).text, "Guess a number between 1 and 100.");
  EXPECT_EQ(env.step("g", act(1, "50"), d).observation.text, "lower");
  EXPECT_EQ(env.step("g", act(2, "maybe 10"), d).observation.text, "higher");
  EXPECT_EQ(env.step("g", act(3, "no idea"), d).observation.text, "Answer with a number.");
  const StepResult r = env.step("g", act(4, "It is 42"), d);
  EXPECT_TRUE(r.done);
  EXPECT_EQ(r.reward, 1.0);
}

TEST(RemoteEnv, RetriesDeadlinesAndErrorsNameTheCall) {
  if (!python_has_grpc()) GTEST_SKIP() << "the test Python has no grpcio/grpcio-tools (scripts/setup.sh installs them)";
  const Deadline d = Deadline::after_seconds(60);
  {
    Server s({"--env", "guess", "--fail-first", "2"});
    ASSERT_TRUE(s.up());
    RemoteEnvironment patient(options(s.address(), 3));
    EpisodeStart e;
    e.session_id = "r";
    e.label = "7";
    EXPECT_EQ(patient.start(e, d).text, "Guess a number between 1 and 100.");  // after 2 UNAVAILABLE
  }
  {
    Server s({"--env", "guess", "--fail-first", "5"});
    ASSERT_TRUE(s.up());
    RemoteEnvironment hasty(options(s.address(), 1));
    EpisodeStart e;
    e.session_id = "r";
    e.prompt_index = 12;
    e.sample_index = 3;
    const std::string err = error_of([&] { hasty.start(e, d); });
    EXPECT_NE(err.find("Start of session r (prompt line 12, sample 3) failed after 2 attempt(s): injected failure 2 "
                       "of 5 (UNAVAILABLE); is the environment running?"),
              std::string::npos)
        << err;
  }
  {
    Server s({"--env", "guess", "--delay", "3"});
    ASSERT_TRUE(s.up());
    RemoteEnvironment slow(options(s.address(), 0, 0.3));
    EpisodeStart e;
    e.session_id = "slow";
    slow.start(e, d);
    const std::string err = error_of([&] { slow.step("slow", act(1, "5"), d); });
    EXPECT_NE(err.find("Step of session slow, turn 1 failed after 1 attempt(s): "), std::string::npos) << err;
    EXPECT_NE(err.find("(DEADLINE_EXCEEDED); each call may take 0.3 s"), std::string::npos) << err;
    // The caller's deadline bounds the retries too.
    RemoteEnvironment retrying(options(s.address(), 5, 0.3));
    EXPECT_THROW(retrying.step("slow", act(2, "5"), Deadline::after_seconds(0.5)), CommError);
  }
  RemoteEnvironment nobody(options("127.0.0.1:1", 1, 2));
  const std::string err = error_of([&] { nobody.check_health(Deadline::after_seconds(10)); });
  EXPECT_NE(err.find("environment 127.0.0.1:1: Health failed after 2 attempt(s): "), std::string::npos) << err;
  EXPECT_NE(err.find("is the environment running?"), std::string::npos) << err;
  EXPECT_THROW(RemoteEnvironment(options("")), ConfigError);
}

}  // namespace
}  // namespace tiller::env
