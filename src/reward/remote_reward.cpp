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
#include "rpc/retry.h"
#include "tiller/core/error.h"
#include "tiller/reward.grpc.pb.h"

namespace tiller::reward {
namespace {

namespace pb = ::tiller::reward::v1;
constexpr int kMaxMessageBytes = 256 << 20;

rpc::RetryOptions retry_options(const RemoteOptions& o) {
  rpc::RetryOptions r;
  r.timeout_seconds = o.timeout_seconds;
  r.retries = o.retries;
  r.backoff_seconds = o.backoff_seconds;
  r.token = o.token;
  return r;
}

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
  rpc::RetryHooks hooks;
  hooks.begin = [&m](grpc::ClientContext& ctx) {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.cancelled) return false;
    m.active.insert(&ctx);
    return true;
  };
  hooks.end = [&m](grpc::ClientContext& ctx) {
    std::lock_guard<std::mutex> lock(m.mu);
    m.active.erase(&ctx);
  };
  hooks.sleep = [this](double seconds) { return backoff(seconds); };
  hooks.cancelled = [this] { return cancelled(); };
  pb::ScoreResponse resp;
  out.retries = rpc::call_with_retries(
      retry_options(opts), {where(), fmt::format("Score for step {} ({} samples)", step, samples.size()), "",
                            "; is the reward service running?",
                            fmt::format("; each call may take reward.remote_timeout_s = {} s", opts.timeout_seconds)},
      Deadline::never(),
      [&](grpc::ClientContext& ctx) {
        resp.Clear();  // nothing of a failed attempt's answer stays
        return m.stub->Score(&ctx, req, &resp);
      },
      hooks);
  out.scores.assign(resp.scores().begin(), resp.scores().end());
  return out;
}

std::string RemoteScorer::check_health(Deadline deadline) {
  Impl& m = *impl_;
  pb::HealthResponse resp;
  rpc::call_with_retries(retry_options(m.opts),
                         {where(), "Health", "check reward.remote_token_file",
                          "; start the reward service or fix the address", "", "failed"},
                         deadline, [&](grpc::ClientContext& ctx) { return m.stub->Health(&ctx, pb::HealthRequest{}, &resp); });
  return resp.name();
}

}  // namespace tiller::reward
