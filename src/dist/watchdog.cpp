// The rank's watchdog (tiller/dist/watchdog.h).
#include "tiller/dist/watchdog.h"

#include <fcntl.h>
#include <mpi.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "tiller/core/clock.h"
#include "tiller/core/logging.h"
#include "tiller/dist/mpi_env.h"

namespace tiller::dist {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPollMs = 100;
// Each rank's "host:port" of its watchdog's socket, in a fixed-size record of the start's exchange.
constexpr int kAddressBytes = 320;
// Connections a failing rank opens at once while asking the others for their lines.
constexpr size_t kConnectBatch = 256;

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
  int listen_fd = -1;                 // this rank's socket; a connection asks for its line
  std::vector<std::string> addresses;  // every rank's "host:port" ("" where it has none)
  std::atomic<bool> line_printed{false};
  std::atomic<bool> ending{false};
  std::atomic<bool> stopping{false};
  std::thread thread;
  // Sends the requests for the other ranks' lines when the job ends: started with the watchdog, so
  // that a failing rank (out of memory, say) need not start a thread then.
  std::thread requester;
  std::mutex request_mu;
  std::condition_variable request_cv;
  bool request = false;
  Deadline request_deadline = Deadline::never();
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
    // A connection to the socket is another rank's request for this rank's line. The socket is not
    // MPI: a thread probing MPI would also drive the progress of every other message of the
    // process, and a rank out of memory then fails inside MPI on this thread, not on the caller's.
    if (s.listen_fd >= 0) {
      pollfd p{s.listen_fd, POLLIN, 0};
      if (::poll(&p, 1, kPollMs) > 0 && (p.revents & POLLIN)) {
        for (int fd; (fd = ::accept(s.listen_fd, nullptr, nullptr)) >= 0;) ::close(fd);
        if (!s.ending && !s.stopping) print_line_once();
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
    }
    if (s.ending || s.stopping) continue;
    if (const std::string why = expired_wait(); !why.empty()) Watchdog::end_job(1, why);
  }
}

// A listening TCP socket on every interface (IPv6 with IPv4 mapped, else IPv4), non-blocking, and
// its port; -1 when the host gives none.
int open_listener(int* port) {
  for (int family : {AF_INET6, AF_INET}) {
    const int fd = ::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int zero = 0;
    if (family == AF_INET6) (void)::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_storage addr{};
    socklen_t len = family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    addr.ss_family = static_cast<sa_family_t>(family);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 && ::listen(fd, 128) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      *port = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                       : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
      return fd;
    }
    ::close(fd);
  }
  return -1;
}

// A non-blocking connection under way to "host:port", or -1.
int connect_to(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(address.substr(0, colon).c_str(), address.c_str() + colon + 1, &hints, &found) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = found; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  return fd;
}

// Asks every rank at `addresses` but `me` for its line: connects to each (a batch at a time), by
// `deadline`. A rank that is gone, or does not answer in time, is left.
void request_lines(const std::vector<std::string>& addresses, int me, Deadline deadline) {
  std::vector<int> peers;
  for (int r = 0; r < static_cast<int>(addresses.size()); ++r)
    if (r != me && !addresses[static_cast<size_t>(r)].empty()) peers.push_back(r);
  for (size_t begin = 0; begin < peers.size() && !deadline.expired(); begin += kConnectBatch) {
    std::vector<pollfd> open;
    for (size_t i = begin; i < std::min(peers.size(), begin + kConnectBatch); ++i)
      if (const int fd = connect_to(addresses[static_cast<size_t>(peers[i])]); fd >= 0) open.push_back({fd, POLLOUT, 0});
    // Connected (or refused) once writable; the peer's watchdog sees the connection either way.
    while (!open.empty() && !deadline.expired()) {
      const int ms = static_cast<int>(std::min(100.0, deadline.remaining_seconds() * 1000) + 1);
      if (::poll(open.data(), open.size(), ms) < 0 && errno != EINTR) break;
      for (auto it = open.begin(); it != open.end();) {
        if (it->revents != 0) {
          ::close(it->fd);
          it = open.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const pollfd& p : open) ::close(p.fd);
  }
}

// The requester thread: waits for end_job, then asks every other rank for its line.
void requester() {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.request_mu);
  s.request_cv.wait(lock, [&] { return s.request || s.stopping; });
  if (!s.request) return;
  try {
    request_lines(s.addresses, s.rank, s.request_deadline);
  } catch (...) {
    // Out of memory or resources on the way out: the job ends at the grace period regardless.
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
  // Every rank's socket address, exchanged once (the start is collective over the world).
  int port = 0;
  s.listen_fd = open_listener(&port);
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int host_len = 0;
  std::vector<char> mine(kAddressBytes, 0), all;
  int size = 0;
  bool exchanged = MPI_Get_processor_name(host, &host_len) == MPI_SUCCESS &&
                   MPI_Comm_size(MPI_COMM_WORLD, &size) == MPI_SUCCESS;
  if (exchanged) {
    const std::string address = s.listen_fd >= 0 ? fmt::format("{}:{}", std::string(host, host_len), port) : "";
    std::memcpy(mine.data(), address.data(), std::min<size_t>(address.size(), kAddressBytes - 1));
    all.assign(static_cast<size_t>(size) * kAddressBytes, 0);
    exchanged = MPI_Allgather(mine.data(), kAddressBytes, MPI_CHAR, all.data(), kAddressBytes, MPI_CHAR,
                              MPI_COMM_WORLD) == MPI_SUCCESS;
  }
  if (exchanged) {
    for (int r = 0; r < size; ++r) s.addresses.emplace_back(all.data() + static_cast<size_t>(r) * kAddressBytes);
  } else {
    log::warn("rank {}: the watchdog's addresses could not be exchanged: when the job fails, only the failing rank "
              "prints where it was", rank);
  }
  if (s.listen_fd < 0)
    log::warn("rank {}: the watchdog could not open a socket ({}): this rank will not print where it was when "
              "another fails", rank, std::strerror(errno));
  s.thread = std::thread(watch);
  if (!s.addresses.empty()) s.requester = std::thread(requester);
}

void Watchdog::stop() {
  State& s = state();
  if (!s.thread.joinable() || s.ending) return;  // ending: the job is aborted, the thread may be the caller
  s.stopping = true;
  {
    std::lock_guard<std::mutex> lock(s.request_mu);
  }
  s.request_cv.notify_all();
  s.thread.join();
  if (s.requester.joinable()) s.requester.join();
  if (s.listen_fd >= 0) ::close(s.listen_fd);
  s.listen_fd = -1;
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
  if (!s.addresses.empty()) {
    // The requests go out on the requester thread (a name lookup has no deadline); the job ends at
    // the grace period's end whether or not they all went.
    const Deadline deadline = Deadline::after_seconds(grace);
    {
      std::lock_guard<std::mutex> lock(s.request_mu);
      s.request = true;
      s.request_deadline = deadline;
    }
    s.request_cv.notify_all();
    std::this_thread::sleep_for(std::chrono::duration<double>(deadline.remaining_seconds()));
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
