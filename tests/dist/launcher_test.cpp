// The NCCL backend's host-side machinery on the CPU: the launcher thread (order, a stuck job left
// behind, an abandoned one not waited for), poll_until's deadline, the handle pool, the watchdog's
// bookkeeping (finished, failed and late ops), and the message of a failed library call.
#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "dist/call_failure.h"
#include "dist/launcher.h"
#include "tiller/core/error.h"

namespace tiller::dist {
namespace {

TEST(Launcher, RunsJobsInOrder) {
  std::vector<int> order;
  std::atomic<int> done{0};
  {
    Launcher l;
    for (int i = 0; i < 100; ++i)
      l.post([&, i] {
        order.push_back(i);
        ++done;
      });
  }  // the destructor waits for the queued jobs
  EXPECT_EQ(done.load(), 100);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
}

// A job stuck in a call (a dead NCCL peer): destruction waits its bounded time and leaves the
// thread behind; an abandoned launcher is not waited for at all. The thread's state outlives the
// Launcher, so the job finishing later touches nothing freed.
TEST(Launcher, AStuckJobIsLeftBehindAndAnAbandonedOneNotWaitedFor) {
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto stuck_job = [release] {
    while (!release->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  const int before = Launcher::left_behind();
  auto t0 = std::chrono::steady_clock::now();
  {
    Launcher l(0.2);
    l.post(stuck_job);
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(waited, 0.2);
  EXPECT_EQ(Launcher::left_behind(), before + 1);
  t0 = std::chrono::steady_clock::now();
  {
    Launcher l(60);
    l.post(stuck_job);
    l.abandon();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_EQ(Launcher::left_behind(), before + 2);
  release->store(true);  // both threads finish their jobs and exit on their own
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

TEST(PollUntil, CallsOnExpiredOnceTheDeadlinePasses) {
  int polls = 0;
  EXPECT_THROW(poll_until([&] { return ++polls < 0; }, Deadline::after_seconds(0.05),
                          [] { throw TimeoutError("late"); }),
               TimeoutError);
  EXPECT_GT(polls, 1);
  polls = 0;
  poll_until([&] { return ++polls == 3; }, Deadline::after_seconds(60), [] { throw TimeoutError("late"); });
  EXPECT_EQ(polls, 3);
}

TEST(HandlePool, ReusesWhatIsGivenBackAndDestroysTheRest) {
  int created = 0, destroyed = 0;
  {
    HandlePool<int> pool([&] { return ++created; }, [&](int) { ++destroyed; });
    const int a = pool.take(), b = pool.take();
    EXPECT_EQ(created, 2);
    pool.give(a);
    EXPECT_EQ(pool.take(), a);  // reused, not created
    EXPECT_EQ(created, 2);
    pool.discard(b);            // maybe still in use on the device: destroyed, never reused
    EXPECT_EQ(destroyed, 1);
    pool.give(a);
    EXPECT_EQ(pool.free_count(), 1u);
  }
  EXPECT_EQ(destroyed, 2);
}

// The watchdog's list: a launched op the device finished, a failed op and a complete one are
// dropped; an op past its deadline is returned (the caller aborts) and the list is emptied.
TEST(OpWatch, DropsFinishedOpsAndReportsTheFirstLateOne) {
  OpWatch w;
  auto ticket = [&](const char* op, int phase, double seconds) {
    auto t = std::make_shared<OpTicket>();
    t->op = op;
    t->phase = phase;
    t->deadline = Deadline::after_seconds(seconds);
    w.add(t);
    return t;
  };
  auto finished = ticket("all_gather", kLaunched, 60);
  auto failed = ticket("broadcast", kFailed, 60);
  auto queued = ticket("reduce_scatter", kQueued, 60);
  auto running = ticket("all_reduce", kLaunched, 60);
  auto on_device_done = [&](OpTicket& t) { return &t == finished.get(); };
  EXPECT_EQ(w.sweep(on_device_done), nullptr);
  EXPECT_EQ(w.size(), 2u);  // queued and running remain
  EXPECT_TRUE(finished->complete.load());
  EXPECT_FALSE(running->complete.load());
  auto late = ticket("send", kQueued, 0);  // an op abandoned in the queue: its deadline passes
  const auto reported = w.sweep(on_device_done);
  ASSERT_NE(reported, nullptr);
  EXPECT_EQ(reported->op, "send");
  EXPECT_EQ(w.size(), 0u);
}

TEST(CallFailure, NamesTheContextTheCallAndTheError) {
  EXPECT_EQ(call_failure("all_gather #7 on group 'actor' (nccl, rank 1 of 4, cuda:1)",
                         "cudaStreamWaitEvent(stream, state->ready, 0)", "an illegal memory access was encountered"),
            "all_gather #7 on group 'actor' (nccl, rank 1 of 4, cuda:1): cudaStreamWaitEvent failed: an illegal "
            "memory access was encountered");
  EXPECT_EQ(call_failure("", "ncclCommCount", "invalid argument"), ": ncclCommCount failed: invalid argument");
}

}  // namespace
}  // namespace tiller::dist
