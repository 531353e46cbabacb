// The environment service's client (remote_env.h). gRPC stays in this file; like the reward
// client it is compiled without libtorch's include directory.
#include "tiller/env/remote_env.h"

#include <cmath>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include "rpc/credentials.h"
#include "rpc/retry.h"
#include "tiller/core/error.h"
#include "tiller/env.grpc.pb.h"

namespace tiller::env {
namespace {

namespace pb = ::tiller::env::v1;

constexpr int kMaxMessageBytes = 64 << 20;

Observation from_pb(const pb::Observation& o) {
  return {o.text(), std::vector<int64_t>(o.token_ids().begin(), o.token_ids().end())};
}

}  // namespace

struct RemoteEnvironment::Impl {
  RemoteEnvOptions opts;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Environment::Stub> stub;

  std::string where() const { return fmt::format("environment {}", opts.address); }

  // One call with its retries (rpc/retry.h): `rpc(ctx)` runs it; `what` names it in errors ("Step
  // of session s, turn 2").
  template <typename Rpc>
  void call(const std::string& what, Deadline deadline, Rpc rpc) {
    rpc::RetryOptions r;
    r.timeout_seconds = opts.timeout_seconds;
    r.retries = opts.retries;
    r.backoff_seconds = opts.backoff_seconds;
    r.token = opts.token;
    rpc::call_with_retries(r,
                           {where(), what, "check the environment's token", "; is the environment running?",
                            fmt::format("; each call may take {} s", opts.timeout_seconds)},
                           deadline, rpc);
  }
};

RemoteEnvironment::RemoteEnvironment(const RemoteEnvOptions& opts) : impl_(std::make_unique<Impl>()) {
  if (opts.address.empty()) throw ConfigError("environment: the address is empty (host:port)");
  if (!(opts.timeout_seconds > 0) || opts.retries < 0 || opts.retries > 100 || !(opts.backoff_seconds >= 0))
    throw ConfigError(fmt::format("environment {}: the timeout must be positive, retries in [0, 100]", opts.address));
  Impl& m = *impl_;
  m.opts = opts;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  m.channel = grpc::CreateCustomChannel(opts.address, rpc::channel_credentials(opts.tls, args), args);
  m.stub = pb::Environment::NewStub(m.channel);
}

RemoteEnvironment::~RemoteEnvironment() = default;

std::string RemoteEnvironment::name() const { return impl_->where(); }

std::string RemoteEnvironment::check_health(Deadline deadline) {
  pb::HealthResponse resp;
  impl_->call("Health", deadline, [&](grpc::ClientContext& ctx) {
    return impl_->stub->Health(&ctx, pb::HealthRequest{}, &resp);
  });
  return resp.name();
}

Observation RemoteEnvironment::start(const EpisodeStart& e, Deadline deadline) {
  pb::StartRequest req;
  req.set_session_id(e.session_id);
  req.set_prompt(e.prompt);
  req.set_label(e.label);
  req.set_data_source(e.data_source);
  req.set_extra_info(e.extra_info);
  req.set_prompt_index(e.prompt_index);
  req.set_sample_index(e.sample_index);
  req.set_step(e.step);
  pb::StartResponse resp;
  impl_->call(fmt::format("Start of session {} (prompt line {}, sample {})", e.session_id, e.prompt_index,
                          e.sample_index),
              deadline, [&](grpc::ClientContext& ctx) { return impl_->stub->Start(&ctx, req, &resp); });
  return from_pb(resp.observation());
}

StepResult RemoteEnvironment::step(const std::string& session_id, const Action& a, Deadline deadline) {
  pb::StepRequest req;
  req.set_session_id(session_id);
  req.set_turn(a.turn);
  req.set_action_text(a.text);
  req.mutable_action_token_ids()->Add(a.tokens.begin(), a.tokens.end());
  req.set_finish_reason(a.finish_reason);
  pb::StepResponse resp;
  const std::string what = fmt::format("Step of session {}, turn {}", session_id, a.turn);
  impl_->call(what, deadline, [&](grpc::ClientContext& ctx) { return impl_->stub->Step(&ctx, req, &resp); });
  if (!std::isfinite(resp.reward()))
    throw CommError(fmt::format("{}: {} answered reward {}; rewards must be finite", impl_->where(), what, resp.reward()));
  return {from_pb(resp.observation()), resp.reward(), resp.done()};
}

void RemoteEnvironment::close(const std::string& session_id, Deadline deadline) {
  pb::CloseRequest req;
  req.set_session_id(session_id);
  pb::CloseResponse resp;
  impl_->call(fmt::format("Close of session {}", session_id), deadline,
              [&](grpc::ClientContext& ctx) { return impl_->stub->Close(&ctx, req, &resp); });
}

}  // namespace tiller::env
