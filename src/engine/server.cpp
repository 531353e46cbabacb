#include "tiller/engine/server.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include "engine/proto_convert.h"
#include "rpc/credentials.h"
#include "tiller/core/logging.h"
#include "tiller/engine/engine.h"
#include "tiller/engine.grpc.pb.h"

namespace tiller::engine {
namespace {

namespace pb = ::tiller::engine::v1;
using Clock = std::chrono::steady_clock;

// One Generate stream's outbox: the loop thread fills it, the handler thread writes it out.
struct StreamState {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<pb::GenerateStreamResponse> out;
  int64_t live = 0;          // requests sent and not yet fully answered
  bool reader_done = false;  // the client finished sending (or the read failed)
  bool closed = false;       // the handler is gone: drop further results

  void push(pb::GenerateStreamResponse r, bool request_done) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) return;
      out.push_back(std::move(r));
      if (request_done) --live;
    }
    cv.notify_all();
  }
};

// A weight sync that failed: End answers ABORTED with the reason.
class SyncFailed : public Error {
 public:
  using Error::Error;
};

struct Route {
  std::shared_ptr<StreamState> stream;
  int64_t remaining = 0;  // samples not yet returned
};

// Fault injection for the tests of a job that loses an engine (docs/cluster.md, standalone
// engines): $TILLER_ENGINE_FAULT = ACTION:PHASE[:N] makes this engine's service, the Nth time
// (default 1) it reaches PHASE, exit at once with code 137 as if killed (ACTION exit), or stop
// there for good, answering nothing more from that thread (stall). PHASE: step (a generation
// step on the loop thread), push (a pushed chunk of a weight sync, on its handler's thread).
void fault_point(const char* phase) {
  static const std::string spec = [] {
    const char* v = std::getenv("TILLER_ENGINE_FAULT");
    return std::string(v ? v : "");
  }();
  if (spec.empty()) return;
  static std::atomic<long> reached{0};
  const auto first = spec.find(':');
  if (first == std::string::npos) return;
  const std::string action = spec.substr(0, first);
  const auto second = spec.find(':', first + 1);
  const std::string where = spec.substr(first + 1, second == std::string::npos ? std::string::npos : second - first - 1);
  const long n = second == std::string::npos ? 1 : std::atol(spec.c_str() + second + 1);
  if (where != phase || ++reached < n) return;
  if (action == "exit") {
    log::warn("TILLER_ENGINE_FAULT: the engine exits at '{}' #{} (a test of losing an engine)", phase, n);
    std::_Exit(137);
  }
  if (action == "stall") {
    log::warn("TILLER_ENGINE_FAULT: the engine stalls at '{}' #{} (a test of losing an engine)", phase, n);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));
  }
}


}  // namespace

struct EngineServer::Impl final : pb::Engine::Service {
  Engine& engine;
  ServerOptions opts;
  std::unique_ptr<grpc::Server> server;
  int bound_port = 0;

  // The loop thread's inbox.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> inbox;
  bool stopping = false;
  std::string failure;

  // Loop-thread state (only the loop thread touches these).
  std::map<uint64_t, Route> routes;
  bool paused = false;
  uint64_t pending_version = 0;
  uint64_t installed_plan = 0;                 // the sync plan's id, 0: none
  bool sync_requested = false;                 // the update in progress receives a sync
  std::optional<WeightSink::Result> sync_result;
  bool draining = false;                        // Drain: no new request; stop once the last is done
  std::mt19937_64 seeds{std::random_device{}()};
  std::deque<std::pair<Clock::time_point, int64_t>> rate_window;

  // Snapshot for Stats/Health, written by the loop thread.
  mutable std::mutex snap_mu;
  EngineStats snap;
  double tokens_per_second = 0;
  uint64_t weight_version = 0;
  bool updating = false;
  bool broken = false;

  // Every open Generate stream (a drain tells each one), guarded by streams_mu.
  std::mutex streams_mu;
  std::set<std::shared_ptr<StreamState>> open_streams;

  std::thread loop;
  std::mutex done_mu;
  std::condition_variable done_cv;
  bool shut = false;
  bool loop_ended = false;

  Impl(Engine& e, const ServerOptions& o) : engine(e), opts(o) {}

  grpc::Status check_token(grpc::ServerContext* ctx) const {
    if (opts.token.empty()) return grpc::Status::OK;
    const auto& md = ctx->client_metadata();
    auto it = md.find("x-tiller-token");
    if (it == md.end() || !secrets_equal(std::string(it->second.data(), it->second.size()), opts.token))
      return {grpc::StatusCode::UNAUTHENTICATED, "missing or wrong x-tiller-token"};
    return grpc::Status::OK;
  }

  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lock(mu);
      inbox.push_back(std::move(f));
    }
    cv.notify_all();
  }

  // Runs `f` on the loop thread and waits for its result until the call's deadline.
  template <typename T>
  grpc::Status call(grpc::ServerContext* ctx, std::function<T()> f, T& result) {
    auto task = std::make_shared<std::packaged_task<T()>>(std::move(f));
    std::future<T> fut = task->get_future();
    post([task] { (*task)(); });
    auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(opts.max_wait_seconds));
    const auto client = ctx->deadline();
    if (client < std::chrono::system_clock::time_point::max())
      until = std::min(until, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 client - std::chrono::system_clock::now()));
    while (fut.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stopping) return {grpc::StatusCode::UNAVAILABLE, "the engine is shutting down"};
      }
      if (Clock::now() >= until) return {grpc::StatusCode::DEADLINE_EXCEEDED, "the engine did not answer in time"};
    }
    try {
      result = fut.get();
    } catch (const InvalidRequest& e) {
      return {grpc::StatusCode::INVALID_ARGUMENT, e.what()};
    } catch (const SyncFailed& e) {
      return {grpc::StatusCode::ABORTED, e.what()};
    } catch (const std::exception& e) {
      return {grpc::StatusCode::FAILED_PRECONDITION, e.what()};
    }
    return grpc::Status::OK;
  }

  // --- loop thread ---
  void add_request(const pb::GenerateRequest& g, const std::shared_ptr<StreamState>& stream) {
    auto refuse = [&](grpc::StatusCode code, const std::string& msg) {
      pb::GenerateStreamResponse r;
      auto* e = r.mutable_error();
      e->set_request_id(g.request_id());
      e->set_code(static_cast<int32_t>(code));
      e->set_message(msg);
      stream->push(std::move(r), true);
    };
    if (draining)
      return refuse(grpc::StatusCode::UNAVAILABLE,
                    fmt::format("request {}: the engine is draining (it takes no new request)", g.request_id()));
    if (!engine.weights_broken().empty())
      return refuse(grpc::StatusCode::FAILED_PRECONDITION,
                    fmt::format("request {}: {}", g.request_id(), engine.weights_broken()));
    if (g.min_weight_version() > weight_version)
      return refuse(grpc::StatusCode::FAILED_PRECONDITION,
                    fmt::format("request {}: needs weight version >= {}, the engine has {}", g.request_id(),
                                g.min_weight_version(), weight_version));
    if (routes.count(g.request_id()))
      return refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    fmt::format("request {}: the id is already in use by a live request", g.request_id()));
    Request req = from_proto(g, seeds());
    try {
      engine.add(req);
    } catch (const InvalidRequest& e) {
      return refuse(grpc::StatusCode::INVALID_ARGUMENT, e.what());
    }
    routes[req.id] = {stream, req.n};
  }

  void deliver(const std::vector<SampleOutput>& outs) {
    for (const auto& o : outs) {
      auto it = routes.find(o.request_id);
      if (it == routes.end()) continue;
      pb::GenerateStreamResponse r;
      to_proto(o, weight_version, *r.mutable_sample());
      const bool last = !o.finish_reason.empty() && --it->second.remaining == 0;  // "": a streamed partial
      it->second.stream->push(std::move(r), last);
      if (last) routes.erase(it);
    }
  }

  void stream_closed(const std::shared_ptr<StreamState>& stream) {
    std::vector<uint64_t> ids;
    for (const auto& [id, route] : routes)
      if (route.stream == stream) ids.push_back(id);
    for (uint64_t id : ids) {
      engine.abort(id);
      routes.erase(id);
    }
  }

  void update_snapshot() {
    const EngineStats s = engine.stats();
    const auto now = Clock::now();
    rate_window.emplace_back(now, s.generated_tokens);
    while (rate_window.size() > 2 && now - rate_window.front().first > std::chrono::seconds(5)) rate_window.pop_front();
    double rate = 0;
    const double span = std::chrono::duration<double>(now - rate_window.front().first).count();
    if (span > 0) rate = static_cast<double>(s.generated_tokens - rate_window.front().second) / span;
    std::lock_guard<std::mutex> lock(snap_mu);
    snap = s;
    tokens_per_second = rate;
    updating = paused;
    broken = !engine.weights_broken().empty();
  }

  void run_loop() {
    auto last_beat = Clock::now();
    try {
      engine.use_device_on_this_thread();  // this thread runs every step, wake and sync of the engine
      for (;;) {
        std::deque<std::function<void()>> work;
        {
          std::unique_lock<std::mutex> lock(mu);
          const bool busy = !paused && engine.has_work();
          if (!busy && inbox.empty() && !stopping)
            cv.wait_for(lock, std::chrono::duration<double>(opts.heartbeat_seconds));
          if (stopping) break;
          work.swap(inbox);
        }
        for (auto& f : work) f();
        if (!paused && engine.has_work()) {
          // The snapshot before the outputs: a client that saw a sample end reads counters that
          // include the step that ended it.
          fault_point("step");
          const std::vector<SampleOutput> outs = engine.step();
          update_snapshot();
          deliver(outs);
          continue;
        }
        if (draining && routes.empty() && !paused) {
          log::info("engine: drained (no request left); it stops serving");
          break;
        }
        if (Clock::now() - last_beat > std::chrono::duration<double>(opts.heartbeat_seconds)) {
          engine.heartbeat();
          last_beat = Clock::now();
        }
        update_snapshot();
      }
      for (auto& [id, route] : routes) engine.abort(id);
      deliver(engine.drain());
      engine.shutdown();
    } catch (const std::exception& e) {
      log::error("engine loop failed: {}", e.what());
      std::lock_guard<std::mutex> lock(mu);
      failure = e.what();
      stopping = true;
    }
    // Wake every stream handler: nothing more will come.
    for (auto& [id, route] : routes) {
      std::lock_guard<std::mutex> lock(route.stream->mu);
      route.stream->closed = true;
      route.stream->cv.notify_all();
    }
    {
      std::lock_guard<std::mutex> lock(done_mu);
      loop_ended = true;
    }
    done_cv.notify_all();
  }

  // --- handlers (gRPC threads) ---
  grpc::Status Generate(grpc::ServerContext* ctx,
                        grpc::ServerReaderWriter<pb::GenerateStreamResponse, pb::GenerateStreamRequest>* rw) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    auto stream = std::make_shared<StreamState>();
    {
      std::lock_guard<std::mutex> lock(streams_mu);
      open_streams.insert(stream);
    }
    std::thread reader([&] {
      pb::GenerateStreamRequest req;
      while (rw->Read(&req)) {
        if (req.has_generate()) {
          {
            std::lock_guard<std::mutex> lock(stream->mu);
            ++stream->live;
          }
          post([this, g = req.generate(), stream] { add_request(g, stream); });
        } else if (req.kind_case() == pb::GenerateStreamRequest::kAbortRequestId) {
          post([this, id = req.abort_request_id(), stream] {
            auto it = routes.find(id);
            if (it != routes.end() && it->second.stream == stream) engine.abort(id);
          });
        } else if (req.kind_case() == pb::GenerateStreamRequest::kReleaseSession) {
          post([this, key = SessionKey{req.release_session().request_id(), req.release_session().sample()}] {
            engine.release_session(key);
          });
        }
      }
      {
        std::lock_guard<std::mutex> lock(stream->mu);
        stream->reader_done = true;
      }
      stream->cv.notify_all();
    });
    bool ok = true;
    for (;;) {
      std::unique_lock<std::mutex> lock(stream->mu);
      stream->cv.wait_for(lock, std::chrono::milliseconds(100), [&] {
        return !stream->out.empty() || (stream->reader_done && stream->live == 0) || stream->closed;
      });
      if (!stream->out.empty()) {
        pb::GenerateStreamResponse r = std::move(stream->out.front());
        stream->out.pop_front();
        lock.unlock();
        if (!rw->Write(r)) {
          ok = false;
          break;
        }
        continue;
      }
      if ((stream->reader_done && stream->live == 0) || stream->closed) break;
      if (ctx->IsCancelled()) {
        ok = false;
        break;
      }
      lock.unlock();
      std::lock_guard<std::mutex> g(mu);
      if (stopping) {
        ok = false;
        break;
      }
    }
    {
      std::lock_guard<std::mutex> lock(streams_mu);
      open_streams.erase(stream);
    }
    {
      std::lock_guard<std::mutex> lock(stream->mu);
      stream->closed = true;
    }
    post([this, stream] { stream_closed(stream); });
    if (!ok) ctx->TryCancel();  // unblocks the reader's Read
    reader.join();
    if (!ok) return {grpc::StatusCode::CANCELLED, "the stream ended before every result was sent"};
    return grpc::Status::OK;
  }

  grpc::Status Abort(grpc::ServerContext* ctx, const pb::AbortRequest* req, pb::AbortResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    std::vector<uint64_t> ids(req->request_ids().begin(), req->request_ids().end()), done;
    auto st = call<std::vector<uint64_t>>(ctx, [this, ids] {
      std::vector<uint64_t> hit;
      for (uint64_t id : ids)
        if (engine.abort(id)) hit.push_back(id);
      return hit;
    }, done);
    for (uint64_t id : done) resp->add_aborted(id);
    return st;
  }

  grpc::Status Health(grpc::ServerContext* ctx, const pb::HealthRequest*, pb::HealthResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!failure.empty()) return {grpc::StatusCode::INTERNAL, "engine failed: " + failure};
    }
    std::lock_guard<std::mutex> lock(snap_mu);
    resp->set_status(updating ? "updating_weights" : broken ? "weights_incomplete" : "serving");
    resp->set_weight_version(weight_version);
    resp->set_model_type(model::family_name(engine.config().family));
    resp->set_vocab_size(engine.config().vocab_size);
    resp->set_max_model_len(engine.max_model_len());
    resp->set_tp_size(engine.tp_size());
    return grpc::Status::OK;
  }

  grpc::Status Stats(grpc::ServerContext* ctx, const pb::StatsRequest*, pb::StatsResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lock(snap_mu);
    to_proto(snap, tokens_per_second, weight_version, *resp);
    return grpc::Status::OK;
  }

  grpc::Status InstallSyncPlan(grpc::ServerContext* ctx, const pb::InstallSyncPlanRequest* req,
                               pb::InstallSyncPlanResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    uint64_t id = 0;
    auto st = call<uint64_t>(ctx, [this, plan = req->plan()] {
      if (paused) throw InvalidRequest(fmt::format("a weight update to version {} is in progress", pending_version));
      installed_plan = engine.install_sync_plan(plan);
      return installed_plan;
    }, id);
    resp->set_plan_id(id);
    return st;
  }

  grpc::Status BeginWeightUpdate(grpc::ServerContext* ctx, const pb::BeginWeightUpdateRequest* req,
                                 pb::WeightUpdateResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    uint64_t v = 0;
    auto st = call<uint64_t>(ctx, [this, version = req->version(), abort_running = req->abort_running(),
                                   plan_id = req->plan_id()] {
      if (paused) throw InvalidRequest(fmt::format("a weight update to version {} is already in progress", pending_version));
      if (version <= weight_version)
        throw InvalidRequest(fmt::format("version {} is not newer than the current {}", version, weight_version));
      if (plan_id != 0 && plan_id != installed_plan)
        throw InvalidRequest(fmt::format("sync plan {:016x} is not installed ({}); call InstallSyncPlan first", plan_id,
                                         installed_plan ? fmt::format("{:016x} is", installed_plan) : "none is"));
      if (abort_running)
        for (auto& [id, route] : routes) engine.abort(id);
      // The step in flight used the old weights: its samples leave with the old version, and the
      // aborted ones go back to their streams.
      deliver(engine.drain());
      paused = true;
      pending_version = version;
      sync_requested = plan_id != 0;
      sync_result.reset();
      update_snapshot();
      // Receive once this answer is on its way: the actor starts sending when every engine has
      // begun, and the loop thread is the receiver until the sync ends or its deadline passes.
      if (sync_requested) post([this, version] { sync_result = engine.receive_weights(version); });
      return weight_version;
    }, v);
    resp->set_weight_version(v);
    return st;
  }

  // Runs on the handler's thread, not the loop's: the sink applies chunks to its copy of the
  // buckets while the loop thread waits in its receive() (and places the finished buckets).
  grpc::Status PushWeights(grpc::ServerContext* ctx, grpc::ServerReader<pb::WeightChunk>* reader,
                           pb::PushWeightsResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    WeightSink* sink = engine.weight_sink();
    if (!sink) return {grpc::StatusCode::FAILED_PRECONDITION, "this engine takes no weight sync (it has no weight sink)"};
    pb::WeightChunk msg;
    int64_t applied = 0;
    while (reader->Read(&msg)) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stopping) return {grpc::StatusCode::UNAVAILABLE, "the engine is shutting down"};
      }
      const WeightChunk c = from_proto(std::move(msg));
      fault_point("push");
      try {
        const std::string why = sink->take_chunk(c, opts.max_wait_seconds);
        if (why.empty()) {
          ++applied;
        } else {
          auto* r = resp->add_resend();
          r->set_bucket(c.bucket);
          r->set_offset(c.offset);
          if (resp->reason().empty()) resp->set_reason(why);
        }
      } catch (const InvalidRequest& e) {
        return {grpc::StatusCode::INVALID_ARGUMENT, e.what()};
      } catch (const std::exception& e) {
        return {grpc::StatusCode::FAILED_PRECONDITION, e.what()};
      }
      msg.Clear();
    }
    resp->set_applied(applied);
    return grpc::Status::OK;
  }

  grpc::Status Drain(grpc::ServerContext* ctx, const pb::DrainRequest*, pb::DrainResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    int64_t live = 0;
    auto st = call<int64_t>(ctx, [this] { return start_draining(); }, live);
    if (!st.ok()) return st;
    tell_streams_draining();
    resp->set_live_requests(live);
    return grpc::Status::OK;
  }

  // --- loop thread ---
  int64_t start_draining() {
    if (!draining) log::info("engine: draining: no new request; {} to finish, then it stops", routes.size());
    draining = true;
    return static_cast<int64_t>(routes.size());
  }

  // Any thread: every open Generate stream hears that the engine drains (kDrainNotice, UNAVAILABLE).
  void tell_streams_draining() {
    std::lock_guard<std::mutex> lock(streams_mu);
    for (const auto& stream : open_streams) {
      pb::GenerateStreamResponse r;
      auto* e = r.mutable_error();
      e->set_request_id(kDrainNotice);
      e->set_code(static_cast<int32_t>(grpc::StatusCode::UNAVAILABLE));
      e->set_message("the engine is draining: it finishes its requests, takes no new one, then stops");
      stream->push(std::move(r), false);
    }
  }

  grpc::Status Sleep(grpc::ServerContext* ctx, const pb::SleepRequest* req, pb::MemoryResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    bool done = false;
    auto st = call<bool>(ctx, [this, level = req->level(), resp] {
      if (paused) throw InvalidRequest(fmt::format("a weight update to version {} is in progress", pending_version));
      if (!routes.empty())
        throw InvalidRequest(fmt::format("{} requests are live; the engine sleeps only when idle", routes.size()));
      deliver(engine.drain());
      engine.sleep(level);
      to_proto(engine.memory(), *resp);
      update_snapshot();
      return true;
    }, done);
    return st;
  }

  grpc::Status Wake(grpc::ServerContext* ctx, const pb::WakeRequest* req, pb::MemoryResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    bool done = false;
    auto st = call<bool>(ctx, [this, weights = req->weights(), cache = req->cache(), resp] {
      if (paused) throw InvalidRequest(fmt::format("a weight update to version {} is in progress", pending_version));
      engine.wake(weights, cache);
      // A hybrid engine starts asleep: its benchmark runs at its first wake (logging.efficiency).
      if (cache) engine.calibrate_if_due();
      to_proto(engine.memory(), *resp);
      update_snapshot();
      return true;
    }, done);
    return st;
  }

  grpc::Status EndWeightUpdate(grpc::ServerContext* ctx, const pb::EndWeightUpdateRequest* req,
                               pb::WeightUpdateResponse* resp) override {
    if (auto st = check_token(ctx); !st.ok()) return st;
    uint64_t v = 0;
    auto st = call<uint64_t>(ctx, [this, version = req->version()] {
      if (!paused) throw InvalidRequest("no weight update is in progress");
      if (version != pending_version)
        throw InvalidRequest(fmt::format("version {} does not match the update in progress ({})", version, pending_version));
      paused = false;
      if (sync_requested) {
        sync_requested = false;
        TILLER_CHECK(sync_result.has_value(), "EndWeightUpdate ran before the sync's receive");
        if (!sync_result->complete) {
          update_snapshot();
          throw SyncFailed(sync_result->weights_changed
                               ? fmt::format("{}; requests are refused until a sync completes", sync_result->error)
                               : fmt::format("{}; the engine keeps serving version {}", sync_result->error,
                                             weight_version));
        }
      }
      {
        std::lock_guard<std::mutex> lock(snap_mu);
        weight_version = version;
      }
      // Live requests continue with the new weights: their KV caches are recomputed first.
      engine.weights_updated(version);
      update_snapshot();
      return weight_version;
    }, v);
    resp->set_weight_version(v);
    return st;
  }
};

// EngineServer::shutdown's grace for calls in flight before gRPC cancels them.
constexpr int kShutdownGraceMs = 500;

EngineServer::EngineServer(Engine& engine, const ServerOptions& opts) : impl_(std::make_unique<Impl>(engine, opts)) {
  TILLER_CHECK(engine.is_leader(), "only the TP leader serves");
  Impl& m = *impl_;
  grpc::ServerBuilder b;
  b.AddListeningPort(opts.address, rpc::server_credentials(opts.tls), &m.bound_port);
  b.RegisterService(&m);
  b.SetMaxReceiveMessageSize(64 << 20);
  b.SetMaxSendMessageSize(64 << 20);
  m.server = b.BuildAndStart();
  if (!m.server || m.bound_port == 0)
    throw IoError(fmt::format("engine server: cannot listen on '{}' (in use, or not a host:port?)", opts.address));
  m.loop = std::thread([&m] { m.run_loop(); });
  log::info("engine serving on port {}{}{}", m.bound_port, opts.tls.serves_tls() ? " over TLS" : "",
            opts.token.empty() ? "" : " (token required)");
}

EngineServer::~EngineServer() { shutdown(); }

int EngineServer::port() const { return impl_->bound_port; }

uint64_t EngineServer::weight_version() const {
  std::lock_guard<std::mutex> lock(impl_->snap_mu);
  return impl_->weight_version;
}

struct LocalSession::Impl {
  EngineServer::Impl* server = nullptr;
  std::shared_ptr<StreamState> stream = std::make_shared<StreamState>();
};

LocalSession::LocalSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

LocalSession::~LocalSession() {
  {
    std::lock_guard<std::mutex> lock(impl_->stream->mu);
    impl_->stream->closed = true;
  }
  impl_->server->post([s = impl_->server, stream = impl_->stream] { s->stream_closed(stream); });
}

void LocalSession::send(const Request& r) {
  {
    std::lock_guard<std::mutex> lock(impl_->stream->mu);
    ++impl_->stream->live;
  }
  pb::GenerateRequest g;
  to_proto(r, 0, g);
  impl_->server->post([s = impl_->server, g = std::move(g), stream = impl_->stream] { s->add_request(g, stream); });
}

void LocalSession::abort(uint64_t request_id) {
  impl_->server->post([s = impl_->server, request_id, stream = impl_->stream] {
    auto it = s->routes.find(request_id);
    if (it != s->routes.end() && it->second.stream == stream) s->engine.abort(request_id);
  });
}

bool LocalSession::next(ClientResult& out, Deadline deadline) {
  StreamState& st = *impl_->stream;
  for (;;) {
    std::unique_lock<std::mutex> lock(st.mu);
    st.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return !st.out.empty() || st.live == 0; });
    if (!st.out.empty()) {
      const pb::GenerateStreamResponse r = std::move(st.out.front());
      st.out.pop_front();
      out = from_proto(r);
      return true;
    }
    if (st.live == 0) return false;
    lock.unlock();
    {
      std::lock_guard<std::mutex> g(impl_->server->mu);
      if (impl_->server->stopping)
        throw CommError("the engine server stopped" +
                        (impl_->server->failure.empty() ? std::string() : ": " + impl_->server->failure));
    }
    if (deadline.expired()) throw TimeoutError("the engine's results did not arrive before the request's deadline");
  }
}

std::unique_ptr<LocalSession> EngineServer::open_local_session() {
  auto impl = std::make_unique<LocalSession::Impl>();
  impl->server = impl_.get();
  return std::unique_ptr<LocalSession>(new LocalSession(std::move(impl)));
}

std::string EngineServer::error() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->failure;
}

void EngineServer::shutdown() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.done_mu);
    if (m.shut) return;
    m.shut = true;
  }
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stopping = true;
  }
  m.cv.notify_all();
  // The handlers see `stopping` within their 100 ms polls and return. gRPC's graceful shutdown
  // then also waits for every client to close its connection, which an idle client (the
  // controller, until its process ends) does not do for seconds: every job's end waited 3.7 s for
  // it on the CPU (2026-11-30). So the grace is short; what is still open after it is cancelled.
  m.server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(kShutdownGraceMs));
  if (m.loop.joinable()) m.loop.join();
  m.done_cv.notify_all();
}

void EngineServer::drain() {
  Impl& m = *impl_;
  m.post([&m] { m.start_draining(); });
  m.tell_streams_draining();
}

void EngineServer::wait() {
  std::unique_lock<std::mutex> lock(impl_->done_mu);
  impl_->done_cv.wait(lock, [&] { return impl_->shut || impl_->loop_ended; });
}

}  // namespace tiller::engine
