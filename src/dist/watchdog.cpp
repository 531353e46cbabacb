// The rank's watchdog (tiller/dist/watchdog.h).
#include "tiller/dist/watchdog.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "tiller/core/logging.h"
#include "tiller/dist/mpi_env.h"

namespace tiller::dist {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kRequestTag = 7001;  // "print your line", on the watchdog's own communicator
constexpr auto kPoll = std::chrono::milliseconds(100);

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Wait {
  long id = 0;
  int thread = 0;  // the rank's thread number, in order of first wait
  std::string what;
  Deadline deadline = Deadline::never();
  std::string key;
  Clock::time_point since;
};

struct State {
  std::mutex mu;
  std::vector<Wait> waits;  // in order of creation: a thread's innermost is its last
  long next_id = 1;
  std::map<std::thread::id, int> threads;
  int rank = -1;
  std::string label;
  std::string phase;
  Clock::time_point phase_since = Clock::now();
  std::function<std::string()> source;
  double grace_s = 3.0;
  bool started = false;
  bool use_mpi = false;
  MPI_Comm comm = MPI_COMM_NULL;
  std::atomic<bool> line_printed{false};
  std::atomic<bool> ending{false};
  std::atomic<bool> stopping{false};
  std::thread thread;
};

// Leaked on purpose: the watchdog thread and end_job may run while statics are being destroyed.
State& state() {
  static State* s = new State;
  return *s;
}

void print(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

// The rank's line, once per job end.
void print_line_once() {
  if (!state().line_printed.exchange(true)) print("tiller: watchdog: " + Watchdog::status_line());
}

// The first wait whose deadline has passed, as a sentence; "" when none.
std::string expired_wait() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (const Wait& w : s.waits)
    if (!w.deadline.is_never() && w.deadline.expired())
      return fmt::format("{} made no progress within its deadline ({}{:.0f} s)", w.what, w.key.empty() ? "" : w.key + " = ",
                         std::chrono::duration<double>(w.deadline.at() - w.since).count());
  return {};
}

void watch() {
  State& s = state();
  while (!s.stopping) {
    std::this_thread::sleep_for(kPoll);
    if (s.ending || s.stopping) continue;
    if (const std::string why = expired_wait(); !why.empty()) Watchdog::end_job(1, why);
    if (!s.use_mpi) continue;
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kRequestTag, s.comm, &flag, &status) != MPI_SUCCESS || !flag) continue;
    int from = -1;
    if (MPI_Recv(&from, 1, MPI_INT, status.MPI_SOURCE, kRequestTag, s.comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) continue;
    print_line_once();
  }
}

}  // namespace

void Watchdog::start(int rank, const std::string& label, double grace_s) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.rank = rank;
    s.label = label;
    s.grace_s = grace_s;
    if (s.started) return;
    s.started = true;
  }
  int provided = MPI_THREAD_SINGLE;
  if (MPI_Query_thread(&provided) == MPI_SUCCESS && provided == MPI_THREAD_MULTIPLE &&
      MPI_Comm_dup(MPI_COMM_WORLD, &s.comm) == MPI_SUCCESS) {
    s.use_mpi = true;
  } else {
    log::warn("rank {}: the MPI library is not thread-safe (MPI_THREAD_MULTIPLE): when the job fails, only the "
              "failing rank prints where it was", rank);
  }
  s.thread = std::thread(watch);
}

void Watchdog::stop() {
  State& s = state();
  if (!s.thread.joinable() || s.ending) return;  // ending: the job is aborted, the thread may be the caller
  s.stopping = true;
  s.thread.join();
}

bool Watchdog::running() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().started;
}

void Watchdog::set_phase(const std::string& phase) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.phase = phase;
  s.phase_since = Clock::now();
}

void Watchdog::set_status_source(std::function<std::string()> source) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.source = std::move(source);
}

std::string Watchdog::status_line() {
  State& s = state();
  std::function<std::string()> source;
  std::string out;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    out = fmt::format("rank {} ({})", s.rank, s.label.empty() ? "?" : s.label);
    if (!s.phase.empty()) out += fmt::format(", phase '{}' ({:.1f} s)", s.phase, seconds_since(s.phase_since));
    // Each thread's innermost wait, the rank's first thread first.
    std::map<int, const Wait*> innermost;
    for (const Wait& w : s.waits) innermost[w.thread] = &w;
    bool first = true;
    for (const auto& [thread, w] : innermost) {
      out += first ? fmt::format(": waiting {:.1f} s in {}", seconds_since(w->since), w->what)
                   : fmt::format(" [thread {}: {:.1f} s in {}]", thread, seconds_since(w->since), w->what);
      first = false;
    }
    if (first) out += ": in no declared wait (computing, or between steps)";
    source = s.source;
  }
  if (source) {
    const std::string extra = source();
    if (!extra.empty()) out += "; " + extra;
  }
  return out;
}

void Watchdog::end_job(int code, const std::string& why) {
  State& s = state();
  if (s.ending.exchange(true)) {
    // Another thread of this rank is ending the job: it aborts it.
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));
  }
  int rank = -1;
  double grace = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    rank = s.rank;
    grace = s.started ? s.grace_s : 0;
  }
  print(fmt::format("tiller: error: rank {}: {}", rank, why));
  print_line_once();
  if (s.use_mpi) {
    int size = 0;
    if (MPI_Comm_size(s.comm, &size) == MPI_SUCCESS) {
      static int me = rank;
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        MPI_Request req;  // never completed: the job is aborted before a dead peer could take it
        if (MPI_Isend(&me, 1, MPI_INT, r, kRequestTag, s.comm, &req) == MPI_SUCCESS) (void)MPI_Request_free(&req);
      }
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(grace));
  }
  MpiEnv::abort_job(code);
}

WaitScope::WaitScope(std::string what, Deadline deadline, std::string key) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  id_ = s.next_id++;
  auto [it, added] = s.threads.emplace(std::this_thread::get_id(), static_cast<int>(s.threads.size()) + 1);
  s.waits.push_back({id_, it->second, std::move(what), deadline, std::move(key), Clock::now()});
}

WaitScope::~WaitScope() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto it = s.waits.end(); it != s.waits.begin();) {
    --it;
    if (it->id == id_) {
      s.waits.erase(it);
      return;
    }
  }
}

bool fault_hang_requested(const char* point) {
  static const std::string spec = [] {
    const char* v = std::getenv("TILLER_FAULT_HANG");
    return std::string(v ? v : "");
  }();
  if (spec.empty()) return false;
  int rank = -1;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    rank = state().rank;
  }
  const std::string here = fmt::format("{}:{}", rank, point);
  if (spec == here) return true;
  if (spec.rfind(here + ":", 0) != 0) return false;
  // "RANK:POINT:N": the Nth time this point is reached, and every later time.
  static std::atomic<long> reached{0};
  return ++reached >= std::atol(spec.c_str() + here.size() + 1);
}

void hang_here(const char* point) {
  log::warn("TILLER_FAULT_HANG: this rank hangs at '{}' (a test of the watchdog)", point);
  WaitScope scope(fmt::format("the hang injected at '{}' (TILLER_FAULT_HANG)", point));
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));
}

}  // namespace tiller::dist
