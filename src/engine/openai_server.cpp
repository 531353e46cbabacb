#include "tiller/engine/openai_server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/engine/server.h"
#include "tiller/model/chat_template.h"
#include "tiller/model/tokenizer.h"

namespace tiller::engine {
namespace {

using json = nlohmann::ordered_json;  // objects keep their keys' order: chat templates render tools and calls as sent

// A request the endpoint answers with an error body: HTTP status, OpenAI error type, the field.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
};

[[noreturn]] void refuse(const std::string& param, const std::string& message) { throw ApiError{400, message, "invalid_request_error", param}; }

std::string error_body(const ApiError& e) {
  return json{{"error",
               {{"message", e.message},
                {"type", e.type},
                {"param", e.param.empty() ? json(nullptr) : json(e.param)},
                {"code", e.status}}}}
      .dump();
}

// The body's fields, typed and bounded; absent or null means the default.
bool present(const json& b, const char* key) { return b.contains(key) && !b.at(key).is_null(); }

double number(const json& b, const char* key, double def, double lo, double hi) {
  if (!present(b, key)) return def;
  const json& v = b.at(key);
  if (!v.is_number()) refuse(key, fmt::format("'{}' must be a number", key));
  const double x = v.get<double>();
  if (!(x >= lo && x <= hi)) refuse(key, fmt::format("'{}' = {} is out of range [{}, {}]", key, x, lo, hi));
  return x;
}

int64_t integer(const json& b, const char* key, int64_t def, int64_t lo, int64_t hi) {
  if (!present(b, key)) return def;
  const json& v = b.at(key);
  if (!v.is_number_integer()) refuse(key, fmt::format("'{}' must be an integer", key));
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi))
    refuse(key, fmt::format("'{}' is out of range [{}, {}]", key, lo, hi));
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) refuse(key, fmt::format("'{}' = {} is out of range [{}, {}]", key, x, lo, hi));
  return x;
}

bool boolean(const json& b, const char* key, bool def) {
  if (!present(b, key)) return def;
  if (!b.at(key).is_boolean()) refuse(key, fmt::format("'{}' must be true or false", key));
  return b.at(key).get<bool>();
}

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

// One finished choice, cut at its first stop string.
struct Choice {
  int64_t prompt = 0, sample = 0;
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
  std::string text;
  std::string finish_reason;
};

std::string finish_of(const std::string& engine_reason) { return engine_reason == "length" ? "length" : "stop"; }

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

}  // namespace

std::optional<ToolCalls> parse_hermes_tool_calls(const std::string& text) {
  static const std::string kOpen = "<tool_call>", kClose = "</tool_call>";
  size_t at = text.find(kOpen);
  if (at == std::string::npos) return std::nullopt;
  ToolCalls out;
  out.content = trim(text.substr(0, at));
  while (at != std::string::npos) {
    const size_t body = at + kOpen.size();
    const size_t end = text.find(kClose, body);
    // An unclosed last block (the reply ran out of tokens, or stopped at </tool_call>) counts
    // when its JSON is whole.
    const std::string inner = trim(text.substr(body, end == std::string::npos ? std::string::npos : end - body));
    json call;
    try {
      call = json::parse(inner);
    } catch (const json::exception&) {
      return std::nullopt;
    }
    if (!call.is_object() || !call.contains("name") || !call.at("name").is_string()) return std::nullopt;
    json args = call.value("arguments", json::object());
    if (args.is_string()) {  // some models write the arguments as a JSON string
      try {
        args = json::parse(args.get<std::string>());
      } catch (const json::exception&) {
        return std::nullopt;
      }
    }
    if (!args.is_object()) return std::nullopt;
    out.calls.emplace_back(call.at("name").get<std::string>(), args.dump());
    if (end == std::string::npos) break;
    at = text.find(kOpen, end + kClose.size());
  }
  return out;
}

// The engine server's local sessions as streams.
class LocalStream final : public OpenAiStream {
 public:
  explicit LocalStream(std::unique_ptr<LocalSession> s) : s_(std::move(s)) {}
  void send(const Request& r) override { s_->send(r); }
  void abort(uint64_t id) override { s_->abort(id); }
  bool next(ClientResult& out, Deadline d) override { return s_->next(out, d); }

 private:
  std::unique_ptr<LocalSession> s_;
};

class ServerBackend final : public OpenAiBackend {
 public:
  explicit ServerBackend(EngineServer& s) : server_(s) {}
  std::unique_ptr<OpenAiStream> open(const std::string& route) override {
    if (!route.empty()) return nullptr;
    return std::make_unique<LocalStream>(server_.open_local_session());
  }
  bool streams_tokens() const override { return true; }

 private:
  EngineServer& server_;
};

std::shared_ptr<OpenAiBackend> engine_server_backend(EngineServer& server) {
  return std::make_shared<ServerBackend>(server);
}

struct OpenAiServer::Impl {
  std::shared_ptr<OpenAiBackend> backend;
  std::shared_ptr<const model::Tokenizer> tok;
  model::ChatTemplate chat;
  std::vector<int64_t> eos;
  int64_t max_model_len = 0;
  OpenAiOptions opts;
  std::unique_ptr<httplib::Server> http;
  std::thread thread;
  int bound_port = 0;
  std::atomic<uint64_t> next_id{uint64_t{1} << 62};  // apart from the ids gRPC clients choose
  std::atomic<uint64_t> next_response{1};
  int64_t created = 0;
  std::mt19937_64 seeds{std::random_device{}()};
  std::mutex seeds_mu;
  bool stopped = false;

  Impl(std::shared_ptr<OpenAiBackend> b, std::shared_ptr<const model::Tokenizer> t, const model::ChatTemplate& c,
       std::vector<int64_t> e, int64_t len, const OpenAiOptions& o)
      : backend(std::move(b)), tok(std::move(t)), chat(c), eos(std::move(e)), max_model_len(len), opts(o) {}

  // --- the request's common fields ---
  void check_model(const json& b) const {
    if (!present(b, "model")) return;
    if (!b.at("model").is_string()) refuse("model", "'model' must be a string");
    const std::string name = b.at("model").get<std::string>();
    if (name != opts.model_name)
      throw ApiError{404, fmt::format("The model '{}' does not exist; this server serves '{}'", name, opts.model_name),
                     "not_found_error", "model"};
  }

  static void refuse_unsupported(const json& b) {
    if (boolean(b, "echo", false)) refuse("echo", "'echo' is not supported");
    if (present(b, "suffix")) refuse("suffix", "'suffix' is not supported");
    if (present(b, "logit_bias") && !(b.at("logit_bias").is_object() && b.at("logit_bias").empty()))
      refuse("logit_bias", "'logit_bias' is not supported");
    if (present(b, "response_format") &&
        !(b.at("response_format").is_object() && b.at("response_format").value("type", "") == "text"))
      refuse("response_format", "'response_format' other than text is not supported");
    for (const char* k : {"presence_penalty", "frequency_penalty"})
      if (number(b, k, 0, -2, 2) != 0) refuse(k, fmt::format("'{}' is not supported (only 0)", k));
    if (number(b, "repetition_penalty", 1, 0, 10) != 1) refuse("repetition_penalty", "'repetition_penalty' is not supported (only 1)");
    if (present(b, "tool_choice")) {
      const json& t = b.at("tool_choice");
      if (!(t.is_string() && (t == "auto" || t == "none")))
        refuse("tool_choice", "'tool_choice' may be auto or none (the model's chat template decides the calls)");
    }
  }

  Generation sampling(const json& b, const char* max_key, int64_t default_max) {
    Generation g;
    refuse_unsupported(b);
    const double temperature = number(b, "temperature", 1.0, 0, 100);
    g.params.greedy = temperature == 0;
    g.params.temperature = temperature == 0 ? 1.0 : temperature;
    g.params.top_p = number(b, "top_p", 1.0, 0, 1);
    if (g.params.top_p <= 0) refuse("top_p", "'top_p' must be in (0, 1]");
    const int64_t vocab = tok->vocab_size();
    const int64_t top_k = integer(b, "top_k", 0, -1, vocab);
    g.params.top_k = top_k < 0 ? 0 : top_k;
    g.params.min_p = number(b, "min_p", 0, 0, 1);
    if (g.params.min_p >= 1) refuse("min_p", "'min_p' must be in [0, 1)");
    g.params.max_new_tokens = integer(b, max_key, default_max, 1, max_model_len);
    g.n = integer(b, "n", 1, 1, opts.max_n);
    if (present(b, "best_of") && integer(b, "best_of", g.n, 1, opts.max_n) != g.n)
      refuse("best_of", "'best_of' is not supported (only equal to n)");
    g.seeded = present(b, "seed");
    if (g.seeded) {
      const json& s = b.at("seed");
      if (!s.is_number_integer()) refuse("seed", "'seed' must be an integer");
      g.params.seed = s.is_number_unsigned() ? s.get<uint64_t>() : static_cast<uint64_t>(s.get<int64_t>());
    } else {
      std::lock_guard<std::mutex> lock(seeds_mu);
      g.params.seed = seeds() >> 1;
    }
    if (present(b, "stop")) {
      const json& s = b.at("stop");
      if (s.is_string()) {
        g.stop.push_back(s.get<std::string>());
      } else if (s.is_array() && static_cast<int64_t>(s.size()) <= opts.max_stop) {
        for (const json& x : s) {
          if (!x.is_string()) refuse("stop", "'stop' must be a string or a list of strings");
          g.stop.push_back(x.get<std::string>());
        }
      } else {
        refuse("stop", fmt::format("'stop' must be a string or a list of at most {} strings", opts.max_stop));
      }
      for (const std::string& x : g.stop)
        if (x.empty() || static_cast<int64_t>(x.size()) > opts.max_stop_bytes)
          refuse("stop", fmt::format("each stop string must hold 1 to {} bytes", opts.max_stop_bytes));
    }
    if (!boolean(b, "ignore_eos", false)) g.params.stop_token_ids = eos;
    if (present(b, "stop_token_ids")) {
      const json& s = b.at("stop_token_ids");
      if (!s.is_array() || static_cast<int64_t>(s.size()) > opts.max_stop)
        refuse("stop_token_ids", fmt::format("'stop_token_ids' must be a list of at most {} token ids", opts.max_stop));
      for (const json& x : s) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= vocab)
          refuse("stop_token_ids", fmt::format("'stop_token_ids' holds ids in [0, {})", vocab));
        g.params.stop_token_ids.push_back(x.get<int64_t>());
      }
    }
    g.stream = boolean(b, "stream", false);
    if (present(b, "stream_options")) {
      if (!b.at("stream_options").is_object()) refuse("stream_options", "'stream_options' must be an object");
      g.include_usage = boolean(b.at("stream_options"), "include_usage", false);
    }
    g.token_ids = boolean(b, "return_token_ids", false);
    return g;
  }

  // --- the engine ---
  // A choice's progress while its tokens stream in.
  struct Track {
    std::vector<int64_t> tokens;
    std::vector<float> logprobs;
    size_t sent_tokens = 0, sent_text = 0;  // what deltas carried so far
    bool started = false, done = false;
  };

  // The text a delta may carry while more may come: not a trailing incomplete character (decoded
  // as U+FFFD), nor a tail that may begin a stop string.
  static size_t safe_length(const std::string& text, const std::vector<std::string>& stop) {
    size_t n = text.size();
    static const std::string kReplacement = "\xEF\xBF\xBD";
    if (n >= kReplacement.size() && text.compare(n - kReplacement.size(), kReplacement.size(), kReplacement) == 0)
      n -= kReplacement.size();
    size_t hold = 0;
    for (const std::string& s : stop)
      for (size_t k = std::min(s.size() - 1, n); k > hold; --k)
        if (text.compare(n - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    return n - hold;
  }

  // A delta of one choice: the text and tokens since the last one; `finish` set on its last.
  struct Delta {
    int64_t prompt = 0, sample = 0;
    bool first = false;
    std::string text;
    std::vector<int64_t> tokens;
    std::vector<float> logprobs;
    std::string finish;
  };

  // Runs every prompt's n samples and returns their choices, ordered by prompt and sample, each
  // cut at its first stop string. With `on_delta` (streaming) the engine sends each new token and
  // the choices go out as deltas; with stop strings it does too, so that a choice ends (and its
  // request is aborted once all its samples ended) as soon as a stop string appears.
  std::vector<Choice> generate(const Generation& g, const std::function<void(const Delta&)>& on_delta) {
    std::unique_ptr<OpenAiStream> session = backend->open(g.route);
    if (!session)
      throw ApiError{404, fmt::format("no agent session '{}' (it ended, or was never opened)", g.route), "not_found_error",
                     ""};
    const Deadline deadline = Deadline::after_seconds(opts.request_timeout_s);
    const auto count = static_cast<uint64_t>(g.prompts.size());
    const uint64_t first = next_id.fetch_add(count);
    const bool stream = backend->streams_tokens() && (on_delta != nullptr || !g.stop.empty());
    for (uint64_t i = 0; i < count; ++i) {
      Request r;
      r.id = first + i;
      r.prompt = g.prompts[i];
      r.params = g.params;
      r.params.seed = g.params.seed + i * static_cast<uint64_t>(g.n);  // sample j of prompt i: seed + i n + j
      r.n = g.n;
      r.stream = stream;
      session->send(r);
    }
    std::map<std::pair<int64_t, int64_t>, Track> tracks;
    std::vector<int64_t> ended(count, 0);
    std::vector<bool> cut_early(count, false);
    std::vector<Choice> out;
    ClientResult c;
    while (session->next(c, deadline)) {
      if (c.error_code != 0) {
        // gRPC's INVALID_ARGUMENT (a bad prompt or parameter) is the caller's; the rest is ours.
        if (c.error_code == 3) throw ApiError{400, c.error, "invalid_request_error", "prompt"};
        throw ApiError{503, c.error, "server_error", ""};
      }
      const auto prompt = static_cast<int64_t>(c.sample.request_id - first);
      Track& t = tracks[{prompt, c.sample.sample}];
      if (t.done) continue;  // cut at a stop string already (its request's abort comes back too)
      if (c.sample.finish_reason == "abort") throw ApiError{503, "the engine aborted the request", "server_error", ""};
      const bool partial = c.sample.finish_reason.empty();
      if (partial) {
        t.tokens.insert(t.tokens.end(), c.sample.tokens.begin(), c.sample.tokens.end());
        t.logprobs.insert(t.logprobs.end(), c.sample.logprobs.begin(), c.sample.logprobs.end());
      } else {
        t.tokens = std::move(c.sample.tokens);
        t.logprobs = std::move(c.sample.logprobs);
      }
      Choice ch;
      ch.prompt = prompt;
      ch.sample = c.sample.sample;
      ch.tokens = t.tokens;
      ch.logprobs = t.logprobs;
      ch.finish_reason = partial ? "" : finish_of(c.sample.finish_reason);
      const size_t before = ch.tokens.size();
      cut_at_stop(ch, g.stop);
      const bool finished = !partial || ch.tokens.size() < before || ch.finish_reason == "stop";
      if (on_delta) {
        Delta d;
        d.prompt = prompt;
        d.sample = ch.sample;
        d.first = !t.started;
        const size_t text_end = finished ? ch.text.size() : safe_length(ch.text, g.stop);
        if (text_end > t.sent_text) d.text = ch.text.substr(t.sent_text, text_end - t.sent_text);
        const size_t token_end = ch.tokens.size();
        if (token_end > t.sent_tokens) {
          d.tokens.assign(ch.tokens.begin() + static_cast<std::ptrdiff_t>(t.sent_tokens), ch.tokens.end());
          d.logprobs.assign(ch.logprobs.begin() + static_cast<std::ptrdiff_t>(t.sent_tokens), ch.logprobs.end());
        }
        if (finished) d.finish = ch.finish_reason;
        if (finished || d.first || !d.text.empty() || !d.tokens.empty()) on_delta(d);
        t.started = true;
        t.sent_text = std::max(t.sent_text, text_end);
        t.sent_tokens = std::max(t.sent_tokens, token_end);
      }
      if (!finished) continue;
      t.done = true;
      if (partial) cut_early[static_cast<size_t>(prompt)] = true;
      // Every sample of the request ended: stop the engine on those still running.
      if (++ended[static_cast<size_t>(prompt)] == g.n && cut_early[static_cast<size_t>(prompt)])
        session->abort(first + static_cast<uint64_t>(prompt));
      out.push_back(std::move(ch));
    }
    std::sort(out.begin(), out.end(),
              [](const Choice& a, const Choice& b) { return std::tie(a.prompt, a.sample) < std::tie(b.prompt, b.sample); });
    return out;
  }

  // The choice's text; with stop strings, up to the first one, and the tokens up to the one that
  // completed it (the shortest prefix whose decoding holds it).
  void cut_at_stop(Choice& ch, const std::vector<std::string>& stop) const {
    ch.text = decode(ch.tokens, /*skip_special=*/true);
    size_t at = std::string::npos;
    const std::string* hit = nullptr;
    for (const std::string& s : stop) {
      const size_t p = ch.text.find(s);
      if (p < at) {
        at = p;
        hit = &s;
      }
    }
    if (!hit) return;
    size_t lo = 1, hi = ch.tokens.size();  // the smallest prefix that holds the stop string
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      const std::vector<int64_t> prefix(ch.tokens.begin(), ch.tokens.begin() + static_cast<std::ptrdiff_t>(mid));
      if (decode(prefix, true).find(*hit) != std::string::npos) hi = mid;
      else lo = mid + 1;
    }
    ch.tokens.resize(lo);
    ch.logprobs.resize(lo);
    ch.text.resize(at);
    ch.finish_reason = "stop";
  }

  // The text of `ids`. A model's vocabulary may be padded past its tokenizer's (Qwen2.5: 151936
  // rows, 151665 tokens): a padding id the engine drew has no text.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const {
    const int64_t vocab = tok->vocab_size();
    if (std::all_of(ids.begin(), ids.end(), [&](int64_t i) { return i >= 0 && i < vocab; }))
      return tok->decode(ids, skip_special);
    std::vector<int64_t> known;
    for (int64_t i : ids)
      if (i >= 0 && i < vocab) known.push_back(i);
    return tok->decode(known, skip_special);
  }

  std::string piece(int64_t id) const { return decode({id}, false); }

  json usage(const Generation& g, const std::vector<Choice>& choices) const {
    int64_t prompt = 0, completion = 0;
    for (const auto& p : g.prompts) prompt += static_cast<int64_t>(p.size());
    for (const Choice& c : choices) completion += static_cast<int64_t>(c.tokens.size());
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
  }

  std::string response_id(const char* prefix) { return fmt::format("{}-{:x}", prefix, next_response.fetch_add(1)); }

  // --- /v1/completions ---
  json completion_logprobs(const Choice& c) const {
    json tokens = json::array(), lps = json::array(), offsets = json::array();
    int64_t offset = 0;
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      const std::string p = piece(c.tokens[i]);
      tokens.push_back(p);
      lps.push_back(c.logprobs[i]);
      offsets.push_back(offset);
      offset += static_cast<int64_t>(p.size());
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", nullptr}, {"text_offset", offsets}};
  }

  json completion_choice(const Generation& g, const Choice& c) const {
    json out{{"index", c.prompt * g.n + c.sample},
             {"text", c.text},
             {"logprobs", g.logprobs ? completion_logprobs(c) : json(nullptr)},
             {"finish_reason", c.finish_reason}};
    if (g.token_ids) {
      out["prompt_token_ids"] = g.prompts[static_cast<size_t>(c.prompt)];
      out["token_ids"] = c.tokens;
    }
    return out;
  }

  Generation completion_request(const json& b) {
    check_model(b);
    Generation g = sampling(b, "max_tokens", 16);
    if (present(b, "logprobs")) {
      const int64_t k = integer(b, "logprobs", 0, 0, 20);
      if (k > 0)
        refuse("logprobs", "only the sampled token's log-prob is computed: use logprobs 0 (no alternatives)");
      g.logprobs = true;
    }
    if (!present(b, "prompt")) refuse("prompt", "'prompt' is required");
    const json& p = b.at("prompt");
    auto ids = [&](const json& a) {
      std::vector<int64_t> out;
      for (const json& x : a) {
        if (!x.is_number_integer()) refuse("prompt", "a token-id prompt holds integers");
        out.push_back(x.get<int64_t>());  // the engine checks the range
      }
      return out;
    };
    if (p.is_string()) {
      g.prompts.push_back(tok->encode(p.get<std::string>(), /*add_special_tokens=*/true));
    } else if (p.is_array() && !p.empty() && p.front().is_number_integer()) {
      g.prompts.push_back(ids(p));
    } else if (p.is_array() && !p.empty()) {
      if (static_cast<int64_t>(p.size()) > opts.max_prompts)
        refuse("prompt", fmt::format("at most {} prompts per request", opts.max_prompts));
      for (const json& x : p) {
        if (x.is_string()) g.prompts.push_back(tok->encode(x.get<std::string>(), true));
        else if (x.is_array()) g.prompts.push_back(ids(x));
        else refuse("prompt", "'prompt' is a string, a list of strings, token ids, or a list of token-id lists");
      }
    } else {
      refuse("prompt", "'prompt' is a string, a list of strings, token ids, or a list of token-id lists");
    }
    for (const auto& x : g.prompts)
      if (x.empty()) refuse("prompt", "a prompt is empty");
    return g;
  }

  // --- /v1/chat/completions ---
  Generation chat_request(const json& b) {
    check_model(b);
    if (!chat.enabled())
      refuse("messages", "this model has no chat template (tiller engine --chat-template); use /v1/completions");
    if (!present(b, "messages") || !b.at("messages").is_array() || b.at("messages").empty() ||
        static_cast<int64_t>(b.at("messages").size()) > opts.max_messages)
      refuse("messages", fmt::format("'messages' must be a list of 1 to {} messages", opts.max_messages));
    std::vector<model::ChatMessage> messages;
    for (const json& m : b.at("messages")) {
      if (!m.is_object() || !m.contains("role") || !m.at("role").is_string())
        refuse("messages", "each message is an object with a 'role'");
      model::ChatMessage msg;
      msg.role = m.at("role").get<std::string>();
      if (msg.role == "developer") msg.role = "system";
      if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
        refuse("messages", fmt::format("unknown role '{}' (system, developer, user, assistant, tool)", msg.role));
      if (present(m, "content")) {
        const json& c = m.at("content");
        if (c.is_string()) {
          msg.content = c.get<std::string>();
        } else if (c.is_array()) {
          for (const json& part : c) {
            if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
                !part.at("text").is_string())
              refuse("messages", "content parts other than text are not supported");
            msg.content += part.at("text").get<std::string>();
          }
        } else {
          refuse("messages", "a message's content is a string or a list of text parts");
        }
      }
      json rest = m;
      rest.erase("role");
      rest.erase("content");
      // OpenAI clients send a call's arguments as a JSON string; chat templates (Qwen2.5's, Llama
      // 3.1's) write them with `tojson`, as the model wrote them: an object.
      if (rest.contains("tool_calls") && rest.at("tool_calls").is_array())
        for (json& call : rest.at("tool_calls"))
          if (call.is_object() && call.contains("function") && call.at("function").is_object()) {
            json& f = call.at("function");
            if (f.contains("arguments") && f.at("arguments").is_string()) {
              try {
                json parsed = json::parse(f.at("arguments").get<std::string>());
                if (parsed.is_object()) f["arguments"] = std::move(parsed);
              } catch (const json::exception&) {
                // Not JSON: the template gets the string as it was sent.
              }
            }
          }
      if (!rest.empty()) msg.fields_json = rest.dump();
      messages.push_back(std::move(msg));
    }
    std::string tools;
    if (present(b, "tools")) {
      if (!b.at("tools").is_array()) refuse("tools", "'tools' must be a list");
      if (!b.at("tools").empty()) tools = b.at("tools").dump();
    }
    const bool add_generation_prompt = boolean(b, "add_generation_prompt", true);
    std::string text;
    try {
      text = chat.render(messages, add_generation_prompt, tools);
    } catch (const ConfigError& e) {
      refuse("messages", std::string("the chat template refused the conversation: ") + e.what());
    }
    std::vector<int64_t> prompt = tok->encode(text, /*add_special_tokens=*/false);
    if (prompt.empty()) refuse("messages", "the conversation renders to no tokens");
    const int64_t room = std::max<int64_t>(1, max_model_len - static_cast<int64_t>(prompt.size()));
    const char* max_key = present(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    Generation g = sampling(b, max_key, room);
    if (boolean(b, "logprobs", false)) g.logprobs = true;
    if (integer(b, "top_logprobs", 0, 0, 20) > 0)
      refuse("top_logprobs", "only the sampled token's log-prob is computed: top_logprobs must be 0");
    g.tools = !tools.empty() && opts.tool_call_parser == "hermes";
    g.prompts.push_back(std::move(prompt));
    return g;
  }

  json chat_logprobs(const Choice& c) const {
    json content = json::array();
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      const std::string p = piece(c.tokens[i]);
      json bytes = json::array();
      for (unsigned char ch : p) bytes.push_back(static_cast<int>(ch));
      content.push_back({{"token", p}, {"logprob", c.logprobs[i]}, {"bytes", bytes}, {"top_logprobs", json::array()}});
    }
    return {{"content", content}};
  }

  // The reply's text with its special tokens (a tool call's tags may be some), without the stop
  // token that ended it.
  std::string raw_text(const Choice& c) const {
    std::vector<int64_t> ids = c.tokens;
    if (!ids.empty() && std::find(eos.begin(), eos.end(), ids.back()) != eos.end()) ids.pop_back();
    return decode(ids, /*skip_special=*/false);
  }

  json chat_choice(const Generation& g, const Choice& c, bool delta) const {
    json message{{"role", "assistant"}, {"content", c.text}};
    std::string finish = c.finish_reason;
    if (g.tools)
      if (const std::optional<ToolCalls> calls = parse_hermes_tool_calls(raw_text(c))) {
        json list = json::array();
        for (size_t i = 0; i < calls->calls.size(); ++i)
          list.push_back({{"id", fmt::format("call_{}_{}_{}", c.prompt, c.sample, i)},
                          {"type", "function"},
                          {"function", {{"name", calls->calls[i].first}, {"arguments", calls->calls[i].second}}}});
        if (delta)
          for (size_t i = 0; i < list.size(); ++i) list[i]["index"] = static_cast<int64_t>(i);
        message["content"] = calls->content.empty() ? json(nullptr) : json(calls->content);
        message["tool_calls"] = list;
        if (finish == "stop") finish = "tool_calls";
      }
    json out{{"index", c.sample},
             {delta ? "delta" : "message", message},
             {"logprobs", g.logprobs ? chat_logprobs(c) : json(nullptr)},
             {"finish_reason", finish}};
    if (g.token_ids) {
      out["prompt_token_ids"] = g.prompts.front();
      out["token_ids"] = c.tokens;
    }
    return out;
  }

  // --- HTTP ---
  void serve(const httplib::Request& req, httplib::Response& res, bool chat_api, const std::string& route) {
    json body;
    try {
      body = json::parse(req.body);
    } catch (const json::exception& e) {
      throw ApiError{400, std::string("the body is not JSON: ") + e.what(), "invalid_request_error", ""};
    }
    if (!body.is_object()) throw ApiError{400, "the body must be a JSON object", "invalid_request_error", ""};
    Generation g = chat_api ? chat_request(body) : completion_request(body);
    g.route = route;
    const std::string id = response_id(chat_api ? "chatcmpl" : "cmpl");
    const int64_t now = static_cast<int64_t>(std::time(nullptr));
    const char* object = chat_api ? "chat.completion" : "text_completion";
    if (!g.stream) {
      const std::vector<Choice> choices = generate(g, nullptr);
      json list = json::array();
      for (const Choice& c : choices) list.push_back(chat_api ? chat_choice(g, c, false) : completion_choice(g, c));
      const json out{{"id", id}, {"object", object},   {"created", now},
                     {"model", opts.model_name}, {"choices", list}, {"usage", usage(g, choices)}};
      res.set_content(out.dump(), "application/json");
      return;
    }
    // Server-sent events: each choice's deltas as its tokens arrive (text held back while it may be
    // an incomplete character or the start of a stop string), its finish reason on its last, then
    // the usage (when asked), then [DONE]. The generation runs in the content provider, on this
    // request's thread.
    res.set_chunked_content_provider("text/event-stream", [this, g, id, now, chat_api](size_t, httplib::DataSink& sink) {
      const char* chunk_object = chat_api ? "chat.completion.chunk" : "text_completion";
      auto send = [&](const json& j) {
        const std::string line = "data: " + j.dump() + "\n\n";
        return sink.write(line.data(), line.size());
      };
      try {
        const std::vector<Choice> choices = generate(g, [&](const Delta& d) {
          if (chat_api && g.tools) return;  // tool calls are read out of the whole reply: sent at its end below
          Choice part;
          part.prompt = d.prompt;
          part.sample = d.sample;
          part.text = d.text;
          part.tokens = d.tokens;
          part.logprobs = d.logprobs;
          json choice;
          if (chat_api) {
            json delta{{"content", d.text}};
            if (d.first) delta["role"] = "assistant";
            choice = {{"index", d.sample},
                      {"delta", delta},
                      {"logprobs", g.logprobs ? chat_logprobs(part) : json(nullptr)},
                      {"finish_reason", d.finish.empty() ? json(nullptr) : json(d.finish)}};
            if (g.token_ids) {
              if (d.first) choice["prompt_token_ids"] = g.prompts.front();
              choice["token_ids"] = d.tokens;
            }
          } else {
            choice = {{"index", d.prompt * g.n + d.sample},
                      {"text", d.text},
                      {"logprobs", g.logprobs ? completion_logprobs(part) : json(nullptr)},
                      {"finish_reason", d.finish.empty() ? json(nullptr) : json(d.finish)}};
            if (g.token_ids) {
              if (d.first) choice["prompt_token_ids"] = g.prompts[static_cast<size_t>(d.prompt)];
              choice["token_ids"] = d.tokens;
            }
          }
          if (!send({{"id", id}, {"object", chunk_object}, {"created", now}, {"model", opts.model_name},
                     {"choices", json::array({choice})}}))
            throw ApiError{499, "the client went away", "client_closed", ""};
        });
        if (chat_api && g.tools)
          for (const Choice& c : choices) {
            json choice = chat_choice(g, c, true);
            if (g.token_ids) choice["prompt_token_ids"] = g.prompts.front();
            if (!send({{"id", id}, {"object", chunk_object}, {"created", now}, {"model", opts.model_name},
                       {"choices", json::array({choice})}}))
              return false;
          }
        if (g.include_usage)
          send({{"id", id}, {"object", chunk_object}, {"created", now}, {"model", opts.model_name},
                {"choices", json::array()}, {"usage", usage(g, choices)}});
      } catch (const ApiError& e) {
        if (e.status == 499) return false;
        send(json::parse(error_body(e)));
      } catch (const std::exception& e) {
        send(json::parse(error_body(ApiError{500, e.what(), "server_error", ""})));
      }
      const std::string done = "data: [DONE]\n\n";
      sink.write(done.data(), done.size());
      sink.done();
      return true;
    });
  }

  void start() {
    created = static_cast<int64_t>(std::time(nullptr));
    if (!opts.tls.cert.empty() || !opts.tls.key.empty()) {
      if (opts.tls.cert.empty() || opts.tls.key.empty())
        throw ConfigError("the OpenAI endpoint's TLS needs both a certificate and its key");
      auto s = std::make_unique<httplib::SSLServer>(opts.tls.cert.c_str(), opts.tls.key.c_str());
      if (!s->is_valid())
        throw ConfigError(fmt::format("the OpenAI endpoint cannot load the TLS certificate {} and key {}", opts.tls.cert,
                                      opts.tls.key));
      http = std::move(s);
    } else {
      http = std::make_unique<httplib::Server>();
    }
    if (opts.threads < 1 || opts.threads > 4096)
      throw ConfigError(fmt::format("the OpenAI endpoint's threads = {}: allowed 1 to 4096", opts.threads));
    const int threads = opts.threads;
    http->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    http->set_payload_max_length(static_cast<size_t>(opts.max_body_bytes));
    http->set_read_timeout(30, 0);
    http->set_write_timeout(30, 0);
    http->set_keep_alive_timeout(2);  // idle client connections do not hold shutdown() long
    http->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (opts.token.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
      const std::string auth = req.get_header_value("Authorization");
      const std::string want = "Bearer " + opts.token;
      if (!secrets_equal(auth, want)) {
        res.status = 401;
        res.set_content(error_body(ApiError{401, "a missing or wrong API key: send 'Authorization: Bearer <the engine's "
                                                 "token>'",
                                            "authentication_error", ""}),
                        "application/json");
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    auto guarded = [this](bool chat_api) {
      return [this, chat_api](const httplib::Request& req, httplib::Response& res) {
        try {
          // /agents/<key>/v1/...: the key is the regex's first group.
          serve(req, res, chat_api, req.matches.size() > 1 ? req.matches[1].str() : std::string());
        } catch (const ApiError& e) {
          res.status = e.status;
          res.set_content(error_body(e), "application/json");
        } catch (const TimeoutError& e) {
          res.status = 504;
          res.set_content(error_body(ApiError{504, e.what(), "timeout", ""}), "application/json");
        } catch (const std::exception& e) {
          log::warn("openai endpoint: {} failed: {}", req.path, e.what());
          res.status = 500;
          res.set_content(error_body(ApiError{500, e.what(), "server_error", ""}), "application/json");
        }
      };
    };
    http->Post("/v1/completions", guarded(false));
    http->Post("/v1/chat/completions", guarded(true));
    http->Post(R"(/agents/([A-Za-z0-9_.-]{1,128})/v1/completions)", guarded(false));
    http->Post(R"(/agents/([A-Za-z0-9_.-]{1,128})/v1/chat/completions)", guarded(true));
    auto models = [this](const httplib::Request&, httplib::Response& res) {
      const json m{{"id", opts.model_name}, {"object", "model"}, {"created", created}, {"owned_by", "tiller"},
                   {"max_model_len", max_model_len}};
      res.set_content(json{{"object", "list"}, {"data", json::array({m})}}.dump(), "application/json");
    };
    http->Get("/v1/models", models);
    // vLLM's /tokenize: a text's token ids under the served tokenizer, for harnesses that build
    // their prompts as ids (the next prompt: the last one, the reply's ids, then these).
    auto tokenize = [this](const httplib::Request& req, httplib::Response& res) {
      try {
        json b;
        try {
          b = json::parse(req.body);
        } catch (const json::exception& e) {
          throw ApiError{400, std::string("the body is not JSON: ") + e.what(), "invalid_request_error", ""};
        }
        if (!b.is_object() || !present(b, "prompt") || !b.at("prompt").is_string())
          refuse("prompt", "'prompt' (a string) is required");
        check_model(b);
        const std::vector<int64_t> ids = tok->encode(b.at("prompt").get<std::string>(), boolean(b, "add_special_tokens", true));
        res.set_content(json{{"tokens", ids}, {"count", ids.size()}, {"max_model_len", max_model_len}}.dump(),
                        "application/json");
      } catch (const ApiError& e) {
        res.status = e.status;
        res.set_content(error_body(e), "application/json");
      }
    };
    http->Post("/tokenize", tokenize);
    http->Post(R"(/agents/([A-Za-z0-9_.-]{1,128})/tokenize)", tokenize);
    http->Get(R"(/agents/([A-Za-z0-9_.-]{1,128})/v1/models)", models);
    http->Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok", "text/plain"); });
    http->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const std::string what = res.status == 404   ? fmt::format("no such route: {} {}", req.method, req.path)
                               : res.status == 413 ? "the request body is over the endpoint's limit"
                                                   : fmt::format("HTTP {}", res.status);
      res.set_content(error_body(ApiError{res.status, what, res.status == 404 ? "not_found_error" : "invalid_request_error",
                                          ""}),
                      "application/json");
    });
    if (opts.port == 0) {
      bound_port = http->bind_to_any_port(opts.host);
      if (bound_port <= 0) throw IoError(fmt::format("the OpenAI endpoint cannot bind {}:<any port>", opts.host));
    } else {
      if (!http->bind_to_port(opts.host, opts.port))
        throw IoError(fmt::format("the OpenAI endpoint cannot bind {}:{} (in use?)", opts.host, opts.port));
      bound_port = opts.port;
    }
    thread = std::thread([this] { http->listen_after_bind(); });
  }
};

OpenAiServer::OpenAiServer(EngineServer& server, std::shared_ptr<const model::Tokenizer> tokenizer,
                           const model::ChatTemplate& chat, std::vector<int64_t> eos_ids, int64_t max_model_len,
                           const OpenAiOptions& opts)
    : OpenAiServer(engine_server_backend(server), std::move(tokenizer), chat, std::move(eos_ids), max_model_len, opts) {}

OpenAiServer::OpenAiServer(std::shared_ptr<OpenAiBackend> backend, std::shared_ptr<const model::Tokenizer> tokenizer,
                           const model::ChatTemplate& chat, std::vector<int64_t> eos_ids, int64_t max_model_len,
                           const OpenAiOptions& opts)
    : impl_(std::make_unique<Impl>(std::move(backend), std::move(tokenizer), chat, std::move(eos_ids), max_model_len,
                                   opts)) {
  TILLER_CHECK(impl_->backend != nullptr, "the OpenAI endpoint needs a backend");
  TILLER_CHECK(impl_->tok != nullptr, "the OpenAI endpoint needs the model's tokenizer");
  if (opts.tool_call_parser != "none" && opts.tool_call_parser != "hermes")
    throw ConfigError(fmt::format("tool call parser '{}': use none or hermes", opts.tool_call_parser));
  impl_->start();
}

OpenAiServer::~OpenAiServer() { shutdown(); }

int OpenAiServer::port() const { return impl_->bound_port; }

void OpenAiServer::shutdown() {
  Impl& m = *impl_;
  if (m.stopped) return;
  m.stopped = true;
  if (m.http) m.http->stop();
  if (m.thread.joinable()) m.thread.join();
}

}  // namespace tiller::engine
