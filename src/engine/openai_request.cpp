// Reading an OpenAI request's body (openai_request.h), and the tool calls in a reply's text
// (parse_hermes_tool_calls, tiller/engine/openai_server.h).
#include "engine/openai_request.h"

#include <algorithm>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/engine/openai_server.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"

namespace tiller::engine::openai {

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

void RequestReader::check_model(const json& b) const {
  if (!present(b, "model")) return;
  if (!b.at("model").is_string()) refuse("model", "'model' must be a string");
  const std::string name = b.at("model").get<std::string>();
  if (name != opts_.model_name)
    throw ApiError{404, fmt::format("The model '{}' does not exist; this server serves '{}'", name, opts_.model_name),
                   "not_found_error", "model"};
}

void RequestReader::refuse_unsupported(const json& b) {
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

Generation RequestReader::sampling(const json& b, const char* max_key, int64_t default_max) {
  Generation g;
  refuse_unsupported(b);
  const double temperature = number(b, "temperature", 1.0, 0, 100);
  g.params.greedy = temperature == 0;
  g.params.temperature = temperature == 0 ? 1.0 : temperature;
  g.params.top_p = number(b, "top_p", 1.0, 0, 1);
  if (g.params.top_p <= 0) refuse("top_p", "'top_p' must be in (0, 1]");
  const int64_t vocab = tok_.vocab_size();
  const int64_t top_k = integer(b, "top_k", 0, -1, vocab);
  g.params.top_k = top_k < 0 ? 0 : top_k;
  g.params.min_p = number(b, "min_p", 0, 0, 1);
  if (g.params.min_p >= 1) refuse("min_p", "'min_p' must be in [0, 1)");
  g.params.max_new_tokens = integer(b, max_key, default_max, 1, max_model_len_);
  g.n = integer(b, "n", 1, 1, opts_.max_n);
  if (present(b, "best_of") && integer(b, "best_of", g.n, 1, opts_.max_n) != g.n)
    refuse("best_of", "'best_of' is not supported (only equal to n)");
  g.seeded = present(b, "seed");
  if (g.seeded) {
    const json& s = b.at("seed");
    if (!s.is_number_integer()) refuse("seed", "'seed' must be an integer");
    g.params.seed = s.is_number_unsigned() ? s.get<uint64_t>() : static_cast<uint64_t>(s.get<int64_t>());
  } else {
    std::lock_guard<std::mutex> lock(seeds_mu_);
    g.params.seed = seeds_() >> 1;
  }
  if (present(b, "stop")) {
    const json& s = b.at("stop");
    if (s.is_string()) {
      g.stop.push_back(s.get<std::string>());
    } else if (s.is_array() && static_cast<int64_t>(s.size()) <= opts_.max_stop) {
      for (const json& x : s) {
        if (!x.is_string()) refuse("stop", "'stop' must be a string or a list of strings");
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      refuse("stop", fmt::format("'stop' must be a string or a list of at most {} strings", opts_.max_stop));
    }
    for (const std::string& x : g.stop)
      if (x.empty() || static_cast<int64_t>(x.size()) > opts_.max_stop_bytes)
        refuse("stop", fmt::format("each stop string must hold 1 to {} bytes", opts_.max_stop_bytes));
  }
  if (!boolean(b, "ignore_eos", false)) g.params.stop_token_ids = eos_;
  if (present(b, "stop_token_ids")) {
    const json& s = b.at("stop_token_ids");
    if (!s.is_array() || static_cast<int64_t>(s.size()) > opts_.max_stop)
      refuse("stop_token_ids", fmt::format("'stop_token_ids' must be a list of at most {} token ids", opts_.max_stop));
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

Generation RequestReader::completion(const json& b) {
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
    g.prompts.push_back(tok_.encode(p.get<std::string>(), /*add_special_tokens=*/true));
  } else if (p.is_array() && !p.empty() && p.front().is_number_integer()) {
    g.prompts.push_back(ids(p));
  } else if (p.is_array() && !p.empty()) {
    if (static_cast<int64_t>(p.size()) > opts_.max_prompts)
      refuse("prompt", fmt::format("at most {} prompts per request", opts_.max_prompts));
    for (const json& x : p) {
      if (x.is_string()) g.prompts.push_back(tok_.encode(x.get<std::string>(), true));
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

Generation RequestReader::chat(const json& b) {
  check_model(b);
  if (!chat_.enabled())
    refuse("messages", "this model has no chat template (tiller engine --chat-template); use /v1/completions");
  if (!present(b, "messages") || !b.at("messages").is_array() || b.at("messages").empty() ||
      static_cast<int64_t>(b.at("messages").size()) > opts_.max_messages)
    refuse("messages", fmt::format("'messages' must be a list of 1 to {} messages", opts_.max_messages));
  std::vector<text::ChatMessage> messages;
  for (const json& m : b.at("messages")) {
    if (!m.is_object() || !m.contains("role") || !m.at("role").is_string())
      refuse("messages", "each message is an object with a 'role'");
    text::ChatMessage msg;
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
            } catch (const openai::json::exception&) {
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
    text = chat_.render(messages, add_generation_prompt, tools);
  } catch (const ConfigError& e) {
    refuse("messages", std::string("the chat template refused the conversation: ") + e.what());
  }
  std::vector<int64_t> prompt = tok_.encode(text, /*add_special_tokens=*/false);
  if (prompt.empty()) refuse("messages", "the conversation renders to no tokens");
  const int64_t room = std::max<int64_t>(1, max_model_len_ - static_cast<int64_t>(prompt.size()));
  const char* max_key = present(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  Generation g = sampling(b, max_key, room);
  if (boolean(b, "logprobs", false)) g.logprobs = true;
  if (integer(b, "top_logprobs", 0, 0, 20) > 0)
    refuse("top_logprobs", "only the sampled token's log-prob is computed: top_logprobs must be 0");
  g.tools = !tools.empty() && opts_.tool_call_parser == "hermes";
  g.prompts.push_back(std::move(prompt));
  return g;
}

}  // namespace tiller::engine::openai

namespace tiller::engine {
namespace {

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
    openai::json call;
    try {
      call = openai::json::parse(inner);
    } catch (const openai::json::exception&) {
      return std::nullopt;
    }
    if (!call.is_object() || !call.contains("name") || !call.at("name").is_string()) return std::nullopt;
    openai::json args = call.value("arguments", openai::json::object());
    if (args.is_string()) {  // some models write the arguments as a JSON string
      try {
        args = openai::json::parse(args.get<std::string>());
      } catch (const openai::json::exception&) {
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

}  // namespace tiller::engine
