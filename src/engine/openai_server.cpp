#include "tiller/engine/openai_server.h"

#include <httplib.h>

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <atomic>
#include <chrono>
#include <map>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/openai_request.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/engine/server.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"

namespace tiller::engine {
namespace {

// How long the endpoint waits for a request's bytes (and a client for a response's) before it
// gives the connection up.
constexpr int kReadTimeoutS = 30;
// Connections the kernel holds for the endpoint to accept. cpp-httplib 0.11 listens with 5
// (compiled into the library): a burst of harness connections on a loaded host overflowed it
// (/proc/net/netstat's ListenOverflows), a connection that waited out its handshake could send its
// request after the endpoint's 2 s keep-alive wait, and the endpoint then closed it unread: the
// client saw a reset (e2e.engine.openai's 28 streams, about one run in seven under ctest -j2).
constexpr int kListenBacklog = 1024;

using openai::ApiError;
using openai::boolean;
using openai::error_body;
using openai::Generation;
using openai::integer;
using openai::json;
using openai::present;
using openai::refuse;

// One finished choice, cut at its first stop string.
struct Choice {
  int64_t prompt = 0, sample = 0;
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;
  std::string text;
  std::string finish_reason;
};

std::string finish_of(const std::string& engine_reason) { return engine_reason == "length" ? "length" : "stop"; }

}  // namespace

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
  std::shared_ptr<const text::Tokenizer> tok;
  text::ChatTemplate chat;
  std::vector<int64_t> eos;
  int64_t max_model_len = 0;
  OpenAiOptions opts;
  std::unique_ptr<httplib::Server> http;
  std::thread thread;
  std::atomic<bool> listening_ended{false};  // listen_after_bind returned (its handlers' threads joined)
  int bound_port = 0;
  std::atomic<uint64_t> next_id{uint64_t{1} << 62};  // apart from the ids gRPC clients choose
  std::atomic<uint64_t> next_response{1};
  int64_t created = 0;
  bool stopped = false;
  openai::RequestReader reader;  // after what it reads against

  Impl(std::shared_ptr<OpenAiBackend> b, std::shared_ptr<const text::Tokenizer> t, const text::ChatTemplate& c,
       std::vector<int64_t> e, int64_t len, const OpenAiOptions& o)
      : backend(std::move(b)), tok(std::move(t)), chat(c), eos(std::move(e)), max_model_len(len), opts(o),
        reader(*tok, chat, eos, max_model_len, opts) {}

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

  // --- /v1/chat/completions ---
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
    Generation g = chat_api ? reader.chat(body) : reader.completion(body);
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
    http->set_read_timeout(kReadTimeoutS, 0);
    http->set_write_timeout(kReadTimeoutS, 0);
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
        reader.check_model(b);
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
      // A 400 with no body is the HTTP server's own: it could not read the request.
      const std::string what =
          res.status == 404   ? fmt::format("no such route: {} {}", req.method, req.path)
          : res.status == 413 ? "the request body is over the endpoint's limit"
          : res.status == 400 ? fmt::format("the request could not be read: a malformed request line or header, or a "
                                            "body that did not arrive within the endpoint's {} s read timeout",
                                            kReadTimeoutS)
                              : fmt::format("HTTP {}", res.status);
      res.set_content(error_body(ApiError{res.status, what, res.status == 404 ? "not_found_error" : "invalid_request_error",
                                          ""}),
                      "application/json");
    });
    // The listening socket, kept to raise its backlog once bound (cpp-httplib applies these options
    // to it before it listens).
    socket_t listening = INVALID_SOCKET;
    http->set_socket_options([&listening](socket_t sock) {
      httplib::default_socket_options(sock);
      listening = sock;
    });
    if (opts.port == 0) {
      bound_port = http->bind_to_any_port(opts.host);
      if (bound_port <= 0) throw IoError(fmt::format("the OpenAI endpoint cannot bind {}:<any port>", opts.host));
    } else {
      if (!http->bind_to_port(opts.host, opts.port))
        throw IoError(fmt::format("the OpenAI endpoint cannot bind {}:{} (in use?)", opts.host, opts.port));
      bound_port = opts.port;
    }
    http->set_socket_options(httplib::default_socket_options);  // `listening` goes out of scope
    if (listening == INVALID_SOCKET)
      throw IoError(fmt::format("the OpenAI endpoint on {}:{}: its listening socket was not seen", opts.host, bound_port));
    if (::listen(listening, kListenBacklog) != 0)
      throw IoError(fmt::format("the OpenAI endpoint cannot raise its listen backlog to {} on {}:{}: {}",
                                kListenBacklog, opts.host, bound_port, std::strerror(errno)));
    thread = std::thread([this] {
      http->listen_after_bind();
      listening_ended = true;
    });
  }
};

OpenAiServer::OpenAiServer(EngineServer& server, std::shared_ptr<const text::Tokenizer> tokenizer,
                           const text::ChatTemplate& chat, std::vector<int64_t> eos_ids, int64_t max_model_len,
                           const OpenAiOptions& opts)
    : OpenAiServer(engine_server_backend(server), std::move(tokenizer), chat, std::move(eos_ids), max_model_len, opts) {}

OpenAiServer::OpenAiServer(std::shared_ptr<OpenAiBackend> backend, std::shared_ptr<const text::Tokenizer> tokenizer,
                           const text::ChatTemplate& chat, std::vector<int64_t> eos_ids, int64_t max_model_len,
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
  if (!m.thread.joinable()) return;
  // httplib's stop() does nothing until the listen thread has begun (is_running()): a shutdown
  // right after the start (a job that fails in its first milliseconds) would leave the accept loop
  // running and the join below waiting forever (cpp-httplib issue 1371). So it waits for the loop
  // to begin (a thread's start) first; once stopped, the loop ends within its 100 ms poll and its
  // handlers at their requests' deadlines.
  while (!m.listening_ended && !m.http->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  m.http->stop();
  m.thread.join();
}

}  // namespace tiller::engine
