// The remote reward client: a queue of batches, worker threads that each run one Score call at a
// time (with its deadline and retries), and results gathered per step. gRPC stays in this file;
// it is compiled without libtorch's include directory (its older protobuf headers would shadow
// the system's).
#include "tiller/reward/remote_reward.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include "rpc/credentials.h"
#include "tiller/core/error.h"
#include "tiller/reward.grpc.pb.h"

namespace tiller::reward {
namespace {

namespace pb = ::tiller::reward::v1;
using Clock = std::chrono::steady_clock;

constexpr double kMaxBackoffSeconds = 8;
constexpr int kMaxMessageBytes = 256 << 20;

const char* code_name(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

bool transient(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::DEADLINE_EXCEEDED ||
         c == grpc::StatusCode::RESOURCE_EXHAUSTED || c == grpc::StatusCode::ABORTED;
}

std::string describe(const grpc::Status& st) {
  return fmt::format("{} ({})", st.error_message().empty() ? "no message" : st.error_message(),
                     code_name(st.error_code()));
}

struct Batch {
  uint64_t epoch = 0, step = 0;
  std::vector<RemoteSample> samples;
};

}  // namespace

struct RemoteReward::Impl {
  RemoteOptions opts;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Reward::Stub> stub;

  std::mutex mu;
  std::condition_variable cv;          // queue changes, results, stopping
  std::deque<Batch> queue;
  Batch pending;                        // the batch being filled
  uint64_t epoch = 0, step = 0;
  int64_t outstanding = 0;              // samples of this epoch sent (or queued) and not yet scored
  std::vector<std::pair<uint64_t, double>> results;
  std::string failure;                  // the first failure of this epoch
  std::set<grpc::ClientContext*> active;
  RemoteStats stats;
  bool stopping = false;
  std::vector<std::thread> workers;

  std::string where() const { return fmt::format("remote reward {} (reward.remote_address)", opts.address); }

  // Sleeps `seconds` unless the client is stopping; returns false when it is.
  bool backoff(std::unique_lock<std::mutex>& lock, double seconds) {
    return !cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return stopping; });
  }

  // One call with its retries. Returns the scores, or sets `error` and returns none.
  std::vector<double> call(const Batch& b, std::string& error) {
    const auto fail = [&error](std::string why) {
      error = std::move(why);
      return std::vector<double>{};
    };
    pb::ScoreRequest req;
    req.set_step(b.step);
    for (const RemoteSample& s : b.samples) {
      pb::RewardSample* r = req.add_samples();
      r->set_id(s.id);
      r->set_prompt(s.prompt);
      r->set_response(s.response);
      r->set_label(s.label);
      r->set_finish_reason(s.finish_reason);
      r->set_prompt_index(s.prompt_index);
      r->set_sample_index(s.sample_index);
      r->set_response_tokens(s.response_tokens);
    }
    double wait = opts.backoff_seconds;
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::duration_cast<std::chrono::system_clock::duration>(
                           std::chrono::duration<double>(opts.timeout_seconds)));
      if (!opts.token.empty()) ctx.AddMetadata("x-tiller-token", opts.token);
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stopping) return fail("the client is shutting down");
        active.insert(&ctx);
      }
      pb::ScoreResponse resp;
      const auto t0 = Clock::now();
      const grpc::Status st = stub->Score(&ctx, req, &resp);
      const double took = std::chrono::duration<double>(Clock::now() - t0).count();
      std::unique_lock<std::mutex> lock(mu);
      active.erase(&ctx);
      if (st.ok()) {
        ++stats.calls;
        stats.call_seconds += took;
        lock.unlock();
        if (resp.scores_size() != static_cast<int>(b.samples.size()))
          return fail(fmt::format("{}: Score for step {} answered {} scores for {} samples", where(), b.step,
                                  resp.scores_size(), b.samples.size()));
        std::vector<double> scores(resp.scores().begin(), resp.scores().end());
        for (size_t i = 0; i < scores.size(); ++i) {
          if (!std::isfinite(scores[i]))
            return fail(fmt::format("{}: Score for step {} answered {} for sample {} of prompt line {}; scores must "
                                    "be finite", where(), b.step, scores[i], b.samples[i].sample_index,
                                    b.samples[i].prompt_index));
        }
        return scores;
      }
      if (stopping) return fail("the client is shutting down");
      if (!transient(st.error_code()) || attempt >= opts.retries) {
        return fail(fmt::format("{}: Score for step {} ({} samples) failed after {} attempt(s): {}{}", where(), b.step,
                            b.samples.size(), attempt + 1, describe(st),
                            st.error_code() == grpc::StatusCode::UNAVAILABLE ? "; is the reward service running?"
                            : st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                                ? fmt::format("; each call may take reward.remote_timeout_s = {} s",
                                              opts.timeout_seconds)
                                : ""));
      }
      ++stats.retries;
      if (!backoff(lock, wait)) return fail("the client is shutting down");
      wait = std::min(wait * 2, kMaxBackoffSeconds);
    }
  }

  void work() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) return;
      Batch b = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      std::string error;
      std::vector<double> scores = call(b, error);
      lock.lock();
      if (b.epoch != epoch) continue;  // a step that was abandoned
      if (error.empty()) {
        for (size_t i = 0; i < scores.size(); ++i) results.emplace_back(b.samples[i].id, scores[i]);
      } else if (failure.empty()) {
        failure = error;
      }
      outstanding -= static_cast<int64_t>(b.samples.size());
      cv.notify_all();
    }
  }

  void enqueue_pending() {  // under mu
    if (pending.samples.empty()) return;
    pending.epoch = epoch;
    pending.step = step;
    queue.push_back(std::move(pending));
    pending = Batch{};
    cv.notify_all();
  }
};

RemoteReward::RemoteReward(const RemoteOptions& opts) : impl_(std::make_unique<Impl>()) {
  TILLER_CHECK(!opts.address.empty(), "remote reward: reward.remote_address is empty (host:port)");
  TILLER_CHECK(opts.batch_size >= 1 && opts.concurrency >= 1 && opts.retries >= 0 && opts.timeout_seconds > 0,
               "remote reward: batch_size, concurrency and timeout must be positive, retries >= 0");
  Impl& m = *impl_;
  m.opts = opts;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  const auto credentials = rpc::channel_credentials(opts.tls, args);
  m.channel = grpc::CreateCustomChannel(opts.address, credentials, args);
  m.stub = pb::Reward::NewStub(m.channel);
  for (int i = 0; i < opts.concurrency; ++i) m.workers.emplace_back([&m] { m.work(); });
}

RemoteReward::~RemoteReward() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stopping = true;
    for (grpc::ClientContext* ctx : m.active) ctx->TryCancel();
  }
  m.cv.notify_all();
  for (auto& t : m.workers) t.join();
}

std::string RemoteReward::check_health(Deadline deadline) {
  Impl& m = *impl_;
  double wait = m.opts.backoff_seconds;
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext ctx;
    const double left = std::min(deadline.remaining_seconds(), m.opts.timeout_seconds);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(left)));
    if (!m.opts.token.empty()) ctx.AddMetadata("x-tiller-token", m.opts.token);
    pb::HealthResponse resp;
    const grpc::Status st = m.stub->Health(&ctx, pb::HealthRequest{}, &resp);
    if (st.ok()) return resp.name();
    // A refused token is the config's to fix (exit code 2: tiller launch does not retry it).
    if (st.error_code() == grpc::StatusCode::UNAUTHENTICATED || st.error_code() == grpc::StatusCode::PERMISSION_DENIED)
      throw ConfigError(fmt::format("{}: Health failed: {}; check reward.remote_token_file", m.where(), describe(st)));
    if (!transient(st.error_code()) || attempt >= m.opts.retries || deadline.remaining_seconds() <= wait) {
      throw CommError(fmt::format("{}: Health failed after {} attempt(s): {}; start the reward service or fix the address",
                                  m.where(), attempt + 1, describe(st)));
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    wait = std::min(wait * 2, kMaxBackoffSeconds);
  }
}

void RemoteReward::begin_step(uint64_t step) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  ++m.epoch;
  m.step = step;
  m.queue.clear();
  m.pending = Batch{};
  m.outstanding = 0;
  m.results.clear();
  m.failure.clear();
}

void RemoteReward::add(RemoteSample s) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  if (!m.failure.empty()) throw CommError(m.failure);
  m.pending.samples.push_back(std::move(s));
  ++m.outstanding;
  if (static_cast<int>(m.pending.samples.size()) >= m.opts.batch_size) m.enqueue_pending();
}

std::vector<std::pair<uint64_t, double>> RemoteReward::finish(Deadline deadline) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  m.enqueue_pending();
  const auto settled = [&] { return m.outstanding == 0 || !m.failure.empty(); };
  bool done = true;
  if (deadline.is_never()) m.cv.wait(lock, settled);
  else done = m.cv.wait_until(lock, deadline.at(), settled);
  if (!m.failure.empty()) throw CommError(m.failure);
  if (!done) {
    throw TimeoutError(fmt::format("{}: {} samples of step {} still have no score at the deadline", m.where(),
                                   m.outstanding, m.step));
  }
  std::vector<std::pair<uint64_t, double>> out;
  out.swap(m.results);
  return out;
}

std::vector<std::pair<uint64_t, double>> RemoteReward::poll() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  if (!m.failure.empty()) throw CommError(m.failure);
  std::vector<std::pair<uint64_t, double>> out;
  out.swap(m.results);
  return out;
}

void RemoteReward::flush() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.enqueue_pending();
}

void RemoteReward::label_step(uint64_t step) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.step = step;
}

RemoteStats RemoteReward::take_stats() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  RemoteStats s = m.stats;
  m.stats = RemoteStats{};
  return s;
}

}  // namespace tiller::reward
