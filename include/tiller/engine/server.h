// The engine's gRPC service (proto/tiller/engine.proto) around one Engine, and the client that
// talks to it (the controller's, and `tiller generate --engine`).
//
// EngineServer: a loop thread owns the Engine and is the only thread that calls it; gRPC handler
// threads post commands to it and wait for their answers with a deadline. Under tensor
// parallelism only the TP leader serves; the other ranks run Engine::follow().
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tiller/core/deadline.h"
#include "tiller/core/tls.h"
#include "tiller/engine/engine.h"

namespace tiller::engine {

struct ServerOptions {
  std::string address = "0.0.0.0:50051";  // host:port to bind; port 0 picks a free one
  std::string token;                      // shared secret required in "x-tiller-token"; empty: none
  double max_wait_seconds = 600;          // cap on waits inside a call (Begin/End, aborts)
  double heartbeat_seconds = 1;           // TP: how often an idle leader tells the followers it lives
  TlsFiles tls;                           // cert + key: serve TLS only
};

struct ClientResult;

// A Generate stream inside the server's process (the OpenAI endpoint's, openai_server.h): the
// same loop, routing, checks and refusals as a gRPC stream, without the wire. send() and next()
// may run on different threads; each alone is not thread-safe.
class LocalSession {
 public:
  ~LocalSession();  // aborts this session's live requests
  // Queues `r` on the engine's loop; a refusal comes back from next() as a result with an error.
  void send(const Request& r);
  void abort(uint64_t request_id);
  // The next result; false once every request sent was answered and taken. Throws TimeoutError
  // past `deadline`, CommError when the server stops.
  bool next(ClientResult& out, Deadline deadline);

 private:
  friend class EngineServer;
  struct Impl;
  explicit LocalSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class EngineServer {
 public:
  // Binds and starts serving at once. Throws IoError naming the address when it cannot bind.
  // `engine` must outlive the server.
  EngineServer(Engine& engine, const ServerOptions& opts);
  ~EngineServer();  // shutdown()
  EngineServer(const EngineServer&) = delete;
  EngineServer& operator=(const EngineServer&) = delete;

  int port() const;  // the bound port
  // Stops accepting calls, ends open streams (their requests are aborted) and the loop thread.
  // Thread-safe; idempotent.
  void shutdown();
  // Blocks until shutdown() was called (by another thread or a signal handler's thread), the loop
  // failed, or a drain ended (every request finished).
  void wait();
  // Starts a drain (as the Drain call does). Thread-safe.
  void drain();
  // The loop thread's failure, if it died (empty while healthy).
  std::string error() const;
  // An in-process stream on this server's engine. Thread-safe.
  std::unique_ptr<LocalSession> open_local_session();
  uint64_t weight_version() const;

 private:
  friend class LocalSession;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The request id of a drain's notice on a Generate stream (a RequestError with code UNAVAILABLE):
// no request has it.
constexpr uint64_t kDrainNotice = ~uint64_t{0};

struct ClientOptions {
  std::string address;           // host:port
  std::string token;             // sent as "x-tiller-token" when not empty
  double timeout_seconds = 60;   // deadline of each unary call
  TlsFiles tls;                  // ca (+ server_name): dial TLS
};

struct ServerHealth {
  std::string status;            // "serving", "updating_weights", or "weights_incomplete" (a sync failed part way)
  uint64_t weight_version = 0;
  std::string model_type;
  int64_t vocab_size = 0, max_model_len = 0;
  int tp_size = 1;
};

// The answer of sleep() and wake(): the leader rank's engine memory, and its process's device memory.
struct ServerMemory {
  EngineMemory engine;
  int64_t device_allocated = 0, device_reserved = 0;
};

struct ServerStats {
  EngineStats engine;
  double kv_cache_usage = 0;
  double tokens_per_second = 0;
  uint64_t weight_version = 0;
};

// A generation result as the client sees it: a sample, or a request the server refused.
struct ClientResult {
  SampleOutput sample;           // when error_code == 0
  uint64_t weight_version = 0;
  int error_code = 0;            // a grpc::StatusCode; the request_id is in sample.request_id
  std::string error;
};

// One Generate stream: send requests at any time, receive results as they finish.
// send() and next() may run on different threads; each alone is not thread-safe.
class GenerateSession {
 public:
  ~GenerateSession();  // cancels the stream if still open
  // Throws CommError when the stream has failed.
  void send(const Request& r, uint64_t min_weight_version = 0);
  void abort(uint64_t request_id);
  // Frees a parked multi-turn session's KV cache (Engine::release_session).
  void release_session(SessionKey key);
  // The next result; false once the stream has ended and every result was taken. Throws
  // TimeoutError past `deadline`, CommError when the stream failed.
  bool next(ClientResult& out, Deadline deadline);
  // No more requests: the server ends the stream after the last result.
  void close_sends();
  // Cancels the stream: the server aborts its requests, and next() returns (throwing CommError)
  // once the results already received are taken. Thread-safe.
  void cancel();

 private:
  friend class EngineClient;
  struct Impl;
  explicit GenerateSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What an engine answered to one PushWeights stream: the chunks it applied, and those it could not
// (by bucket and offset), to be pushed again in full, with the first one's reason.
struct PushAnswer {
  int64_t applied = 0;
  std::vector<std::pair<int, uint64_t>> resend;
  std::string reason;
};

// One PushWeights stream (delta sync, docs/sync.md): write chunks, then finish() for the answer.
// One thread at a time.
class WeightPushStream {
 public:
  ~WeightPushStream();  // cancels the stream unless finished
  // False when the stream has failed (finish() then says why).
  bool write(const WeightChunk& c);
  // Ends the stream and returns the engine's answer. Throws InvalidRequest (a chunk the engine
  // refused), TimeoutError past the stream's deadline, CommError otherwise, each naming the engine.
  PushAnswer finish();

 private:
  friend class EngineClient;
  struct Impl;
  explicit WeightPushStream(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Errors: CommError naming the address and the gRPC status (UNAVAILABLE: is the engine
// running?), TimeoutError past a deadline. Thread-safe (gRPC channels are).
class EngineClient {
 public:
  explicit EngineClient(const ClientOptions& opts);
  ~EngineClient();

  // Opens a stream that lives until `deadline`.
  std::unique_ptr<GenerateSession> open_session(Deadline deadline);
  // Sends every request on one stream and returns every sample (in finishing order). A refused
  // request throws InvalidRequest with the server's message (the others are aborted).
  std::vector<SampleOutput> generate(const std::vector<Request>& requests, Deadline deadline);

  ServerHealth health();
  ServerStats stats();
  std::vector<uint64_t> abort(const std::vector<uint64_t>& request_ids);
  // The weight sync's control exchange (docs/sync.md): the plan once per run (returns its id;
  // InvalidRequest when it does not fit the engine), then Begin and End once per sync. Begin with
  // a plan_id makes the engine receive the sync from the actor; End waits for it (give it the
  // sync's deadline) and throws CommError with the engine's reason when the sync failed.
  uint64_t install_sync_plan(const std::string& plan);
  uint64_t begin_weight_update(uint64_t version, bool abort_running = false, uint64_t plan_id = 0);
  uint64_t end_weight_update(uint64_t version, double timeout_s = 0);
  // Delta sync: a stream of chunks of the update Begin named (with the installed plan's id), open
  // until `deadline`.
  std::unique_ptr<WeightPushStream> push_weights(Deadline deadline);
  // Drain (proto/tiller/engine.proto): no new request, the live ones finished, then the engine stops
  // serving. Returns how many requests it still holds.
  int64_t drain();
  // The hybrid engine's phases (Engine::sleep / wake). InvalidRequest when the engine is busy.
  ServerMemory sleep(int level);
  ServerMemory wake(bool weights, bool cache);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::engine
