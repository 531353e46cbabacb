#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include "engine/proto_convert.h"
#include "rpc/credentials.h"
#include "tiller/engine.grpc.pb.h"
#include "tiller/engine/server.h"

namespace tiller::engine {
namespace {

namespace pb = ::tiller::engine::v1;

std::chrono::system_clock::time_point wall(Deadline d) {
  if (d.is_never()) return std::chrono::system_clock::time_point::max();
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::duration<double>(d.remaining_seconds()));
}

[[noreturn]] void raise(const std::string& address, const char* what, const grpc::Status& st) {
  const std::string msg = fmt::format("engine {}: {} failed: {} ({})", address, what, st.error_message(),
                                      static_cast<int>(st.error_code()));
  if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) throw TimeoutError(msg);
  if (st.error_code() == grpc::StatusCode::INVALID_ARGUMENT) throw InvalidRequest(msg);
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE) throw CommError(msg + "; is the engine running at that address?");
  throw CommError(msg);
}

}  // namespace

struct GenerateSession::Impl {
  std::string address;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<pb::GenerateStreamRequest, pb::GenerateStreamResponse>> rw;
  std::mutex write_mu;
  std::thread reader;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<ClientResult> results;
  bool ended = false;
  grpc::Status status;
  bool sends_closed = false;

  void read_all() {
    pb::GenerateStreamResponse r;
    while (rw->Read(&r)) {
      ClientResult c = from_proto(r);
      {
        std::lock_guard<std::mutex> lock(mu);
        results.push_back(std::move(c));
      }
      cv.notify_all();
    }
    grpc::Status st = rw->Finish();
    {
      std::lock_guard<std::mutex> lock(mu);
      status = st;
      ended = true;
    }
    cv.notify_all();
  }
};

GenerateSession::GenerateSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GenerateSession::~GenerateSession() {
  if (!impl_) return;
  impl_->ctx.TryCancel();
  if (impl_->reader.joinable()) impl_->reader.join();
}

void GenerateSession::send(const Request& r, uint64_t min_weight_version) {
  pb::GenerateStreamRequest req;
  to_proto(r, min_weight_version, *req.mutable_generate());
  std::lock_guard<std::mutex> lock(impl_->write_mu);
  if (impl_->sends_closed || !impl_->rw->Write(req))
    throw CommError(fmt::format("engine {}: the Generate stream is closed", impl_->address));
}

void GenerateSession::abort(uint64_t request_id) {
  pb::GenerateStreamRequest req;
  req.set_abort_request_id(request_id);
  std::lock_guard<std::mutex> lock(impl_->write_mu);
  if (!impl_->sends_closed) impl_->rw->Write(req);
}

void GenerateSession::release_session(SessionKey key) {
  pb::GenerateStreamRequest req;
  req.mutable_release_session()->set_request_id(key.request);
  req.mutable_release_session()->set_sample(static_cast<int32_t>(key.sample));
  std::lock_guard<std::mutex> lock(impl_->write_mu);
  if (!impl_->sends_closed) impl_->rw->Write(req);
}

void GenerateSession::close_sends() {
  std::lock_guard<std::mutex> lock(impl_->write_mu);
  if (impl_->sends_closed) return;
  impl_->sends_closed = true;
  impl_->rw->WritesDone();
}

void GenerateSession::cancel() { impl_->ctx.TryCancel(); }

bool GenerateSession::next(ClientResult& out, Deadline deadline) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  const bool ready = m.cv.wait_until(lock, deadline.is_never() ? std::chrono::steady_clock::time_point::max()
                                                               : deadline.at(),
                                     [&] { return !m.results.empty() || m.ended; });
  if (!ready) throw TimeoutError(fmt::format("engine {}: no result before the deadline", m.address));
  if (!m.results.empty()) {
    out = std::move(m.results.front());
    m.results.pop_front();
    return true;
  }
  if (!m.status.ok()) raise(m.address, "Generate", m.status);
  return false;
}

struct EngineClient::Impl {
  ClientOptions opts;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Engine::Stub> stub;

  void prepare(grpc::ClientContext& ctx, Deadline d) const {
    ctx.set_deadline(wall(d));
    if (!opts.token.empty()) ctx.AddMetadata("x-tiller-token", opts.token);
  }
  Deadline unary() const { return Deadline::after_seconds(opts.timeout_seconds); }
};

EngineClient::EngineClient(const ClientOptions& opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = opts;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  const auto credentials = rpc::channel_credentials(opts.tls, args);
  impl_->channel = grpc::CreateCustomChannel(opts.address, credentials, args);
  impl_->stub = pb::Engine::NewStub(impl_->channel);
}

EngineClient::~EngineClient() = default;

std::unique_ptr<GenerateSession> EngineClient::open_session(Deadline deadline) {
  auto s = std::make_unique<GenerateSession::Impl>();
  s->address = impl_->opts.address;
  impl_->prepare(s->ctx, deadline);
  s->rw = impl_->stub->Generate(&s->ctx);
  GenerateSession::Impl* raw = s.get();
  s->reader = std::thread([raw] { raw->read_all(); });
  return std::unique_ptr<GenerateSession>(new GenerateSession(std::move(s)));
}

std::vector<SampleOutput> EngineClient::generate(const std::vector<Request>& requests, Deadline deadline) {
  auto session = open_session(deadline);
  for (const auto& r : requests) session->send(r);
  session->close_sends();
  std::vector<SampleOutput> out;
  ClientResult c;
  while (session->next(c, deadline)) {
    if (c.error_code != 0) throw InvalidRequest(c.error);
    out.push_back(std::move(c.sample));
  }
  return out;
}

ServerHealth EngineClient::health() {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::HealthResponse r;
  grpc::Status st = impl_->stub->Health(&ctx, pb::HealthRequest(), &r);
  if (!st.ok()) raise(impl_->opts.address, "Health", st);
  ServerHealth h;
  h.status = r.status();
  h.weight_version = r.weight_version();
  h.model_type = r.model_type();
  h.vocab_size = r.vocab_size();
  h.max_model_len = r.max_model_len();
  h.tp_size = r.tp_size();
  return h;
}

ServerStats EngineClient::stats() {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::StatsResponse r;
  grpc::Status st = impl_->stub->Stats(&ctx, pb::StatsRequest(), &r);
  if (!st.ok()) raise(impl_->opts.address, "Stats", st);
  return from_proto(r);
}

std::vector<uint64_t> EngineClient::abort(const std::vector<uint64_t>& ids) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::AbortRequest req;
  req.mutable_request_ids()->Add(ids.begin(), ids.end());
  pb::AbortResponse r;
  grpc::Status st = impl_->stub->Abort(&ctx, req, &r);
  if (!st.ok()) raise(impl_->opts.address, "Abort", st);
  return {r.aborted().begin(), r.aborted().end()};
}

uint64_t EngineClient::install_sync_plan(const std::string& plan) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::InstallSyncPlanRequest req;
  req.set_plan(plan);
  pb::InstallSyncPlanResponse r;
  grpc::Status st = impl_->stub->InstallSyncPlan(&ctx, req, &r);
  if (!st.ok()) raise(impl_->opts.address, "InstallSyncPlan", st);
  return r.plan_id();
}

uint64_t EngineClient::begin_weight_update(uint64_t version, bool abort_running, uint64_t plan_id) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::BeginWeightUpdateRequest req;
  req.set_version(version);
  req.set_abort_running(abort_running);
  req.set_plan_id(plan_id);
  pb::WeightUpdateResponse r;
  grpc::Status st = impl_->stub->BeginWeightUpdate(&ctx, req, &r);
  if (!st.ok()) raise(impl_->opts.address, "BeginWeightUpdate", st);
  return r.weight_version();
}

uint64_t EngineClient::end_weight_update(uint64_t version, double timeout_s) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, timeout_s > 0 ? Deadline::after_seconds(timeout_s) : impl_->unary());
  pb::EndWeightUpdateRequest req;
  req.set_version(version);
  pb::WeightUpdateResponse r;
  grpc::Status st = impl_->stub->EndWeightUpdate(&ctx, req, &r);
  if (!st.ok()) raise(impl_->opts.address, "EndWeightUpdate", st);
  return r.weight_version();
}

struct WeightPushStream::Impl {
  std::string address;
  grpc::ClientContext ctx;
  pb::PushWeightsResponse answer;
  std::unique_ptr<grpc::ClientWriter<pb::WeightChunk>> writer;
  bool finished = false;
};

WeightPushStream::WeightPushStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WeightPushStream::~WeightPushStream() {
  if (impl_ && !impl_->finished) impl_->ctx.TryCancel();
}

bool WeightPushStream::write(const WeightChunk& c) {
  pb::WeightChunk m;
  to_proto(c, m);
  return impl_->writer->Write(m);
}

PushAnswer WeightPushStream::finish() {
  Impl& m = *impl_;
  m.finished = true;
  m.writer->WritesDone();
  const grpc::Status st = m.writer->Finish();
  if (!st.ok()) raise(m.address, "PushWeights", st);
  PushAnswer a;
  a.applied = m.answer.applied();
  for (const auto& r : m.answer.resend()) a.resend.emplace_back(r.bucket(), r.offset());
  a.reason = m.answer.reason();
  return a;
}

std::unique_ptr<WeightPushStream> EngineClient::push_weights(Deadline deadline) {
  auto s = std::make_unique<WeightPushStream::Impl>();
  s->address = impl_->opts.address;
  impl_->prepare(s->ctx, deadline);
  s->writer = impl_->stub->PushWeights(&s->ctx, &s->answer);
  return std::unique_ptr<WeightPushStream>(new WeightPushStream(std::move(s)));
}

int64_t EngineClient::drain() {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::DrainResponse r;
  grpc::Status st = impl_->stub->Drain(&ctx, pb::DrainRequest(), &r);
  if (!st.ok()) raise(impl_->opts.address, "Drain", st);
  return r.live_requests();
}

ServerMemory EngineClient::sleep(int level) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::SleepRequest req;
  req.set_level(level);
  pb::MemoryResponse r;
  grpc::Status st = impl_->stub->Sleep(&ctx, req, &r);
  if (!st.ok()) raise(impl_->opts.address, "Sleep", st);
  return from_proto(r);
}

ServerMemory EngineClient::wake(bool weights, bool cache) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx, impl_->unary());
  pb::WakeRequest req;
  req.set_weights(weights);
  req.set_cache(cache);
  pb::MemoryResponse r;
  grpc::Status st = impl_->stub->Wake(&ctx, req, &r);
  if (!st.ok()) raise(impl_->opts.address, "Wake", st);
  return from_proto(r);
}

}  // namespace tiller::engine
