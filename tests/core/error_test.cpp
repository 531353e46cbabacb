#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/worker_pool.h"
#include "tiller/core/checked_math.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller {
namespace {

TEST(Error, CheckNamesFileLineAndMessage) {
  try {
    int gpus = 3;
    TILLER_CHECK(gpus % 2 == 0, "gpus = {} must be even", gpus);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_EQ(m.rfind("tests/core/error_test.cpp:", 0), 0u) << m;
    EXPECT_NE(m.find(": gpus = 3 must be even"), std::string::npos) << m;
  }
  try {
    TILLER_CHECK(1 + 1 == 3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("check '1 + 1 == 3' failed"), std::string::npos) << e.what();
  }
}

TEST(Error, TypesAndExitCodes) {
  EXPECT_EQ(exit_code_for(ConfigError("x")), 2);
  EXPECT_EQ(exit_code_for(TimeoutError("x")), 1);
  EXPECT_EQ(exit_code_for(std::runtime_error("x")), 1);
  // A timeout is a communication error; callers may catch either.
  EXPECT_THROW(throw TimeoutError("t"), CommError);
}

TEST(Error, LineDropsTheStackTraceOfALibtorchError) {
  // The shape of a c10::Error's what(): the message, then the C++ stack.
  const std::runtime_error oom(
      "CUDA out of memory. Tried to allocate 594.00 MiB. GPU 1 has a total capacity of 139.80 GiB.\n"
      "Exception raised from malloc at /pytorch/c10/cuda/CUDACachingAllocator.cpp:1574 (most recent call first):\n"
      "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7fc6 in libc10.so)\n");
  EXPECT_EQ(error_line(oom), "CUDA out of memory. Tried to allocate 594.00 MiB. GPU 1 has a total capacity of 139.80 GiB.");
  EXPECT_EQ(error_line(ConfigError("a.yaml: key 'x': unknown\n")), "a.yaml: key 'x': unknown");
  EXPECT_EQ(error_line(std::runtime_error("plain")), "plain");
}

TEST(Deadline, ExpiresAndNever) {
  EXPECT_TRUE(Deadline::after_seconds(0).expired());
  EXPECT_FALSE(Deadline::after_seconds(60).expired());
  EXPECT_GT(Deadline::after_seconds(60).remaining_seconds(), 59);
  EXPECT_FALSE(Deadline::never().expired());
  EXPECT_TRUE(Deadline::never().is_never());
  // A duration whose sum with now() would overflow the clock is no deadline, not one in the past.
  EXPECT_TRUE(Deadline::after_seconds(1e300).is_never());
  EXPECT_TRUE(Deadline::after_seconds(std::nan("")).is_never());
  EXPECT_FALSE(Deadline::after_seconds(1e8).expired());
}

TEST(CheckedMath, OverflowNamesWhatWasComputed) {
  EXPECT_EQ(checked_add(3, 4, "a + b"), 7);
  EXPECT_EQ(checked_mul(-3, 4, "a x b"), -12);
  try {
    checked_add(int64_t{1} << 62, int64_t{1} << 62, "prompt + max_new_tokens");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "prompt + max_new_tokens overflows 64-bit integers (4611686018427387904 + 4611686018427387904)");
  }
  EXPECT_THROW(checked_mul(int64_t{1} << 32, int64_t{1} << 31, "batch x samples"), ConfigError);
}

TEST(Logging, LevelsFromConfigAndEnvironment) {
  EXPECT_EQ(log::parse_level("debug"), log::Level::kDebug);
  EXPECT_THROW(log::parse_level("loud"), ConfigError);
  unsetenv("TILLER_LOG_LEVEL");
  log::init(3, "actor", log::Level::kWarn);
  EXPECT_EQ(log::level(), log::Level::kWarn);
  setenv("TILLER_LOG_LEVEL", "error", 1);
  log::init(3, "actor", log::Level::kInfo);
  EXPECT_EQ(log::level(), log::Level::kError);
  unsetenv("TILLER_LOG_LEVEL");
}

TEST(Logging, PrefixCarriesRankAndRole) {
  ::testing::internal::CaptureStderr();
  log::init(5, "critic", log::Level::kInfo);
  log::info("value loss {}", 0.5);
  log::debug("hidden");
  std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find("[5 critic] value loss 0.5"), std::string::npos) << out;
  EXPECT_EQ(out.find("hidden"), std::string::npos) << out;
}

}  // namespace
}  // namespace tiller

// --- WorkerPool (core/worker_pool.h): the threads of the env runner, the batched reward and the
// agent harnesses ---
namespace tiller {
namespace {

TEST(WorkerPool, RunsTasksKeepsClosesThroughShutdownAndLeavesABlockedTaskBehind) {
  auto count = std::make_shared<std::atomic<int>>(0);
  {
    WorkerPool pool(4, "test pool", "test.concurrency");
    for (int i = 0; i < 64; ++i) pool.submit([count] { ++*count; });
    for (int i = 0; i < 500 && pool.busy() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(count->load(), 64);
    EXPECT_EQ(pool.busy(), 0u);
    pool.submit([] { throw std::runtime_error("a task's own failure"); });  // logged, the pool goes on
    pool.submit([count] { ++*count; });
    for (int i = 0; i < 500 && pool.busy() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(count->load(), 65);
  }
  // One thread held by a task: the queued ones wait; shutdown drops those not kept and runs the kept.
  auto gate = std::make_shared<std::atomic<bool>>(false);
  auto kept = std::make_shared<std::atomic<int>>(0), dropped = std::make_shared<std::atomic<int>>(0);
  WorkerPool pool(1, "test pool", "test.concurrency");
  pool.submit([gate] {
    while (!*gate) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  for (int i = 0; i < 3; ++i) {
    pool.submit([dropped] { ++*dropped; });
    pool.submit([kept] { ++*kept; }, /*keep=*/true);
  }
  EXPECT_EQ(pool.busy(), 7u);
  std::thread opener([gate] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    *gate = true;
  });
  EXPECT_TRUE(pool.shutdown(10));
  opener.join();
  EXPECT_EQ(kept->load(), 3);
  EXPECT_EQ(dropped->load(), 0);
  pool.submit([dropped] { ++*dropped; });  // after shutdown: not run
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(dropped->load(), 0);

  // A task blocked past the grace is left behind: shutdown says so and returns; the task, holding
  // only what it shares, ends later without touching the pool's owner.
  auto stuck = std::make_shared<std::atomic<bool>>(true);
  {
    WorkerPool p(1, "test pool", "test.concurrency");
    p.submit([stuck] {
      while (*stuck) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(p.shutdown(0.05));
  }
  *stuck = false;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));

  for (int bad : {0, WorkerPool::kMaxThreads + 1}) {
    try {
      WorkerPool p(bad, "x", "env.concurrency");
      ADD_FAILURE() << bad;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), fmt::format("env.concurrency = {}: allowed 1 to 4096", bad));
    }
  }
}

}  // namespace
}  // namespace tiller
