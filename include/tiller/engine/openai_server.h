// An OpenAI-compatible HTTP endpoint in front of an engine's service (docs/engine.md, "OpenAI
// endpoint"): /v1/models, /v1/completions and /v1/chat/completions (and vLLM's /tokenize: a text's
// token ids), for agent harnesses written against the `openai` client. Token-faithful: the text a
// choice returns is the decoding of the tokens the engine sampled, and with `return_token_ids` (as
// vLLM and SGLang take it) the prompt's and the completion's token ids come back with each choice,
// with their log-probs under `logprobs`. Requests go to the engine through a backend: an engine
// server's local sessions (the loop, the checks and the refusals of the gRPC path, without the
// wire), or a training job's agent sessions.
//
// What a request may carry: prompts as text or token ids (one or a list), chat messages (content
// as text or text parts; tool calls, tool results and `tools` go to the model's chat template),
// max_tokens (max_completion_tokens), temperature (0: greedy), top_p, top_k, min_p, n, seed, stop
// (strings) and stop_token_ids, ignore_eos, logprobs (the sampled token's: `logprobs: 0` or
// `true`; alternatives are not computed, so top_logprobs > 0 is refused), stream (server-sent
// events, token by token), return_token_ids. Refused with a 400 naming
// the field: anything out of its bounds (OpenAiOptions), echo, best_of, suffix, logit_bias,
// response_format, a model name other than the served one (404). With a token, every call needs
// `Authorization: Bearer <token>` (else 401).
//
// Stop strings end a choice at their first occurrence in the decoded text (the text stops before
// it; the tokens and log-probs end with the token that completed it). The engine streams each
// token to the endpoint (Request::stream) when a request streams or has stop strings, so a stop
// string ends the generation as soon as it appears (the request is aborted once all its samples
// ended).
//
// Where requests go (OpenAiBackend): an engine server's local sessions (`tiller engine
// --openai-port`), or a training job's agent sessions (the openai_agent sample loop), which serve
// /agents/<key>/v1/... for each sample: the same API under a per-sample base URL.
//
// Threading: the HTTP server's own pool; each request holds one backend stream.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tiller/core/deadline.h"
#include "tiller/core/tls.h"

namespace tiller::text {
class Tokenizer;
class ChatTemplate;
}  // namespace tiller::text

namespace tiller::engine {

class EngineServer;
struct Request;
struct ClientResult;

// One HTTP request's way to the engine: LocalSession's contract (server.h). send() and next() run
// on the request's thread.
class OpenAiStream {
 public:
  virtual ~OpenAiStream() = default;  // abandons what is still live (aborted)
  // Queues `r`; a refusal comes back from next() as a result with an error (code 3: the caller's).
  virtual void send(const Request& r) = 0;
  virtual void abort(uint64_t request_id) = 0;
  // The next result; false once every request sent was answered and taken. Throws TimeoutError
  // past `deadline`.
  virtual bool next(ClientResult& out, Deadline deadline) = 0;
};

class OpenAiBackend {
 public:
  virtual ~OpenAiBackend() = default;
  // A stream for one HTTP request. `route`: the key of an /agents/<key>/v1/... path, "" for
  // /v1/...; nullptr when the backend has no such route (the endpoint answers 404).
  virtual std::unique_ptr<OpenAiStream> open(const std::string& route) = 0;
  // Whether requests may stream tokens (Request::stream): choices then stream token by token and
  // stop strings end a generation early; else each choice arrives whole.
  virtual bool streams_tokens() const = 0;
};

// The backend of `tiller engine`: the server's local sessions (route "" only). `server` must
// outlive what this returns.
std::shared_ptr<OpenAiBackend> engine_server_backend(EngineServer& server);

struct OpenAiOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                 // 0: a free port (port() says which)
  std::string token;               // "Authorization: Bearer <token>" required when set
  TlsFiles tls;                    // cert + key: HTTPS only
  std::string model_name;          // the id /v1/models lists and requests may name
  double request_timeout_s = 600;  // a request's deadline for all its choices
  // Requests served at once: each open request holds one of the HTTP server's threads until its
  // last choice is answered, and more wait in its queue; so this caps how many sequences the
  // endpoint's clients keep in the engine at once. Set it to the concurrency the callers bring
  // (tiller engine: the engine's max_num_seqs; the agent loop: agent.concurrency). At most 4096.
  int threads = 16;
  // How chat replies' tool calls are read out of their text when the request gave `tools`: "none"
  // (the text is the content), or "hermes" (Hermes' and Qwen2.5's <tool_call>{"name": ...,
  // "arguments": {...}}</tool_call> blocks become message.tool_calls, finish_reason "tool_calls").
  std::string tool_call_parser = "none";
  // Bounds of one request.
  int64_t max_body_bytes = int64_t{32} << 20;
  int64_t max_prompts = 256;       // prompts of one completions request
  int64_t max_n = 128;             // choices per prompt
  int64_t max_stop = 16;           // stop strings (and stop_token_ids)
  int64_t max_stop_bytes = 256;    // each
  int64_t max_messages = 4096;     // chat messages
};

// A reply's tool calls in the Hermes / Qwen2.5 format: `content` is the text before the first
// <tool_call> block (trimmed; may be empty), `calls` each block's name and arguments (a JSON
// object's text). nullopt when the text has no block, or a block that is not such JSON (the reply
// is then all content, as vLLM's hermes parser leaves it).
struct ToolCalls {
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;
};
std::optional<ToolCalls> parse_hermes_tool_calls(const std::string& text);

class OpenAiServer {
 public:
  // Binds and serves at once; IoError naming the address when it cannot bind. `server` must
  // outlive this. `eos_ids`: the model's end-of-sequence tokens, each choice's stop tokens unless
  // the request says ignore_eos. `chat` may have no format (chat requests are then refused).
  OpenAiServer(EngineServer& server, std::shared_ptr<const text::Tokenizer> tokenizer, const text::ChatTemplate& chat,
               std::vector<int64_t> eos_ids, int64_t max_model_len, const OpenAiOptions& opts);
  // The same in front of any backend.
  OpenAiServer(std::shared_ptr<OpenAiBackend> backend, std::shared_ptr<const text::Tokenizer> tokenizer,
               const text::ChatTemplate& chat, std::vector<int64_t> eos_ids, int64_t max_model_len,
               const OpenAiOptions& opts);
  ~OpenAiServer();  // shutdown()
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;

  int port() const;
  // Stops accepting requests and waits for the server thread. Idempotent.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::engine
