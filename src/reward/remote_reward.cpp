// The remote reward client: one Score call per batch, with its deadline and retries (the batching
// and the worker threads are the BatchedReward's). gRPC stays in this file; it is compiled
// without libtorch's include directory (its older protobuf headers would shadow the system's).
#include "tiller/reward/remote_reward.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include "rpc/credentials.h"
#include "rpc/status.h"
#include "tiller/core/error.h"
#include "tiller/reward.grpc.pb.h"

namespace tiller::reward {
namespace {

namespace pb = ::tiller::reward::v1;
using rpc::describe;
using rpc::transient;

constexpr double kMaxBackoffSeconds = 8;
constexpr int kMaxMessageBytes = 256 << 20;

}  // namespace

struct RemoteScorer::Impl {
  RemoteOptions opts;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Reward::Stub> stub;
  std::mutex mu;
  std::set<grpc::ClientContext*> active;  // calls in flight, cancelled by on_cancel()
  bool cancelled = false;
};

RemoteScorer::RemoteScorer(const RemoteOptions& opts) : impl_(std::make_unique<Impl>()) {
  TILLER_CHECK(!opts.address.empty(), "remote reward: reward.remote_address is empty (host:port)");
  TILLER_CHECK(opts.retries >= 0 && opts.timeout_seconds > 0,
               "remote reward: the timeout must be positive and retries >= 0");
  Impl& m = *impl_;
  m.opts = opts;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  const auto credentials = rpc::channel_credentials(opts.tls, args);
  m.channel = grpc::CreateCustomChannel(opts.address, credentials, args);
  m.stub = pb::Reward::NewStub(m.channel);
}

RemoteScorer::~RemoteScorer() = default;

std::string RemoteScorer::where() const {
  return fmt::format("remote reward {} (reward.remote_address)", impl_->opts.address);
}

void RemoteScorer::on_cancel() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.cancelled = true;
  for (grpc::ClientContext* ctx : m.active) ctx->TryCancel();
}

BatchScores RemoteScorer::score(uint64_t step, const std::vector<RewardSample>& samples) {
  Impl& m = *impl_;
  const RemoteOptions& opts = m.opts;
  pb::ScoreRequest req;
  req.set_step(step);
  for (const RewardSample& s : samples) {
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
  BatchScores out;
  double wait = opts.backoff_seconds;
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         std::chrono::duration<double>(opts.timeout_seconds)));
    if (!opts.token.empty()) ctx.AddMetadata("x-tiller-token", opts.token);
    {
      std::lock_guard<std::mutex> lock(m.mu);
      if (m.cancelled) throw CommError(fmt::format("{}: the client is shutting down", where()));
      m.active.insert(&ctx);
    }
    pb::ScoreResponse resp;
    const grpc::Status st = m.stub->Score(&ctx, req, &resp);
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.active.erase(&ctx);
    }
    if (st.ok()) {
      out.scores.assign(resp.scores().begin(), resp.scores().end());
      return out;
    }
    if (cancelled()) throw CommError(fmt::format("{}: the client is shutting down", where()));
    if (!transient(st.error_code()) || attempt >= opts.retries) {
      throw CommError(fmt::format("{}: Score for step {} ({} samples) failed after {} attempt(s): {}{}", where(), step,
                                  samples.size(), attempt + 1, describe(st),
                                  st.error_code() == grpc::StatusCode::UNAVAILABLE ? "; is the reward service running?"
                                  : st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                                      ? fmt::format("; each call may take reward.remote_timeout_s = {} s",
                                                    opts.timeout_seconds)
                                      : ""));
    }
    ++out.retries;
    if (!backoff(wait)) throw CommError(fmt::format("{}: the client is shutting down", where()));
    wait = std::min(wait * 2, kMaxBackoffSeconds);
  }
}

std::string RemoteScorer::check_health(Deadline deadline) {
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
      throw ConfigError(fmt::format("{}: Health failed: {}; check reward.remote_token_file", where(), describe(st)));
    if (!transient(st.error_code()) || attempt >= m.opts.retries || deadline.remaining_seconds() <= wait) {
      throw CommError(fmt::format("{}: Health failed after {} attempt(s): {}; start the reward service or fix the address",
                                  where(), attempt + 1, describe(st)));
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    wait = std::min(wait * 2, kMaxBackoffSeconds);
  }
}

}  // namespace tiller::reward
