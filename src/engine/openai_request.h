// Reading an OpenAI request's body (/v1/completions, /v1/chat/completions) into what it asks of
// the engine, every field typed and bounded; private to the endpoint (openai_server.cpp).
#pragma once

#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tiller/engine/openai_server.h"
#include "tiller/model/sampling_params.h"

namespace tiller::text {
class ChatTemplate;
class Tokenizer;
}  // namespace tiller::text

namespace tiller::engine::openai {

using json = nlohmann::ordered_json;  // objects keep their keys' order: chat templates render tools and calls as sent

// A request the endpoint answers with an error body: HTTP status, OpenAI error type, the field.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
};

// Refuses the request with a 400 naming `param`.
[[noreturn]] void refuse(const std::string& param, const std::string& message);
// The OpenAI error body of `e`.
std::string error_body(const ApiError& e);

// The body's fields, typed and bounded; absent or null means the default. A field of the wrong
// type or out of [lo, hi] is refused naming it.
bool present(const json& b, const char* key);
double number(const json& b, const char* key, double def, double lo, double hi);
int64_t integer(const json& b, const char* key, int64_t def, int64_t lo, int64_t hi);
bool boolean(const json& b, const char* key, bool def);

// What one request asks of the engine, for each of its prompts.
struct Generation {
  std::vector<std::vector<int64_t>> prompts;
  model::SamplingParams params;
  int64_t n = 1;
  bool seeded = false;
  std::vector<std::string> stop;
  bool logprobs = false;
  bool token_ids = false;
  bool stream = false;
  bool include_usage = false;
  bool tools = false;  // chat with tools (and a tool-call parser): replies' tool calls are read out
  std::string route;   // the agent session of an /agents/<key>/v1/... path ("" for /v1/...)
};

// Reads request bodies against one model: its tokenizer and chat template, its end-of-sequence
// ids and context length, and the endpoint's bounds (OpenAiOptions). A request without a seed gets
// one of its own. Thread-safe.
class RequestReader {
 public:
  // Holds references: the caller keeps the tokenizer, template, ids and options alive.
  RequestReader(const text::Tokenizer& tok, const text::ChatTemplate& chat, const std::vector<int64_t>& eos,
                int64_t max_model_len, const OpenAiOptions& opts)
      : tok_(tok), chat_(chat), eos_(eos), max_model_len_(max_model_len), opts_(opts) {}

  // A /v1/completions body: its prompts (text or token ids) and sampling.
  Generation completion(const json& body);
  // A /v1/chat/completions body: its messages (and tools) through the chat template, and sampling.
  Generation chat(const json& body);
  // A 404 when the body names another model than the one served.
  void check_model(const json& b) const;

 private:
  static void refuse_unsupported(const json& b);
  Generation sampling(const json& b, const char* max_key, int64_t default_max);

  const text::Tokenizer& tok_;
  const text::ChatTemplate& chat_;
  const std::vector<int64_t>& eos_;
  const int64_t max_model_len_;
  const OpenAiOptions& opts_;
  std::mt19937_64 seeds_{std::random_device{}()};
  std::mutex seeds_mu_;
};

}  // namespace tiller::engine::openai
