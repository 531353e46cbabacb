// The openai_agent loop's sessions (private to src/controller; agent_loop.cpp): how an HTTP
// request of the agent endpoint reaches the controller's thread and gets its answers back
// (AgentShared's inbox, each request's StreamBox), the endpoint's backend over them, and the pool of
// threads that run the harness calls.
//
// Threading: the endpoint's threads open streams, send and wait; the harness threads run harness
// calls; the controller's thread takes the inbox and the finished calls, and answers the boxes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "tiller/controller/agent.h"
#include "tiller/engine/openai_server.h"
#include "tiller/engine/server.h"

namespace tiller::controller {

// The results of one HTTP request, handed over from the controller's thread.
struct StreamBox {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<engine::ClientResult> results;
  int64_t pending = 0;  // requests sent and not answered yet
};

// What the HTTP threads queue for the controller's thread.
struct Inbound {
  bool abort = false;
  std::string route;
  std::shared_ptr<StreamBox> box;
  engine::Request request;   // a request: the endpoint's (its id is the endpoint's)
  uint64_t endpoint_id = 0;  // an abort: the endpoint's id (0: every live request of the box)
};

struct AgentShared {
  std::mutex mu;
  std::deque<Inbound> inbox;
  std::unordered_set<std::string> routes;  // the samples' keys that take requests
  bool closed = false;                     // the loop is gone: requests are refused at once
};

// Hands `r` to the box's waiting request (one of its pending ones).
void answer(StreamBox& box, engine::ClientResult r);
// Answers one of the box's pending requests with an error (`code`: a gRPC status code; 3 is the
// caller's, a 400).
void refuse(StreamBox& box, uint64_t endpoint_id, int code, std::string message);
constexpr int kUnavailable = 14;  // gRPC's code: the endpoint answers 503

// The agent endpoint's backend: a stream per HTTP request on a route in `shared->routes`; choices
// arrive whole (no Request::stream).
std::shared_ptr<engine::OpenAiBackend> agent_backend(std::shared_ptr<AgentShared> shared);

// The harness calls, on threads of their own (detached: a call in progress at destruction is left
// behind, and ends with its HTTP requests' refusals); results come back through take().
class HarnessPool {
 public:
  struct Result {
    uint64_t key = 0;
    AgentOutcome outcome;
    std::string error;  // the call threw
    double seconds = 0;
  };
  HarnessPool(std::shared_ptr<AgentHarness> harness, int threads);
  ~HarnessPool();
  void run(uint64_t key, AgentTask task, Deadline deadline);
  std::vector<Result> take();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace tiller::controller
