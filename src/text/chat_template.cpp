#include "tiller/text/chat_template.h"

#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "python/interpreter.h"
#include "python/jinja.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/core/logging.h"
#include "tiller/model/model_config.h"
#include "tiller/text/tokenizer.h"

namespace tiller::text {

namespace fs = std::filesystem;
using json = nlohmann::json;
// The template sees keys in the order the data wrote them (tool schemas and calls go through tojson).
using ordered_json = nlohmann::ordered_json;

struct ChatTemplate::Jinja {
  std::string source, tool_source;
  ordered_json variables;  // bos_token, eos_token, ...
  std::vector<std::string> stop_texts;
  std::string origin;
};

ChatFormat parse_chat_format(const std::string& name, const Tokenizer& tok) {
  if (name == "none") return ChatFormat::kNone;
  if (name == "chatml") return ChatFormat::kChatML;
  if (name == "llama3") return ChatFormat::kLlama3;
  if (name == "auto") {
    if (tok.token_to_id("<|im_start|>")) return ChatFormat::kChatML;
    if (tok.token_to_id("<|start_header_id|>")) return ChatFormat::kLlama3;
    return ChatFormat::kNone;
  }
  throw ConfigError(fmt::format("chat template '{}' is unknown; use auto, chatml, llama3 or none", name));
}

const char* chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::kNone: return "none";
    case ChatFormat::kChatML: return "chatml";
    case ChatFormat::kLlama3: return "llama3";
    case ChatFormat::kJinja: return "jinja";
  }
  return "?";
}

namespace {

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::string render_builtin(ChatFormat format, const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string out;
  switch (format) {
    case ChatFormat::kNone:
    case ChatFormat::kJinja:
      for (const auto& m : messages) out += m.content;
      return out;
    case ChatFormat::kChatML:
      // Qwen2.5's template without its default system prompt: a run of tool messages is one user
      // turn of <tool_response> blocks.
      for (size_t i = 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role != "tool") {
          out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
          continue;
        }
        if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
        out += "\n<tool_response>\n" + m.content + "\n</tool_response>";
        if (i + 1 == messages.size() || messages[i + 1].role != "tool") out += "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      return out;
    case ChatFormat::kLlama3:
      // As Meta's Llama-3 template: BOS once, contents trimmed; a tool's answer is the ipython role's turn.
      out = "<|begin_of_text|>";
      for (const auto& m : messages)
        out += "<|start_header_id|>" + (m.role == "tool" ? std::string("ipython") : m.role) + "<|end_header_id|>\n\n" +
               trim(m.content) + "<|eot_id|>";
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;
  }
  return out;
}

// tokenizer_config.json names special tokens as strings or as {"content": ...} objects.
std::string token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

json read_json(const fs::path& p) {
  const auto text = read_file(p.string());
  if (!text) throw IoError(fmt::format("{}: cannot read the file", p.string()));
  try {
    return json::parse(*text);
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("{}: not valid JSON ({})", p.string(), e.what()));
  }
}

// The variables transformers gives a template besides the conversation: the tokenizer's named
// special tokens (special_tokens_map.json, then tokenizer_config.json's).
json special_token_variables(const fs::path& dir) {
  json vars = json::object();
  for (const char* file : {"special_tokens_map.json", "tokenizer_config.json"}) {
    const fs::path p = dir / file;
    if (!fs::exists(p)) continue;
    const json j = read_json(p);
    if (!j.is_object()) continue;
    for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
      if (j.contains(key) && !token_text(j[key]).empty()) vars[key] = token_text(j[key]);
  }
  return vars;
}

struct JinjaSources {
  std::string source, tool_source, origin;
};

// The model's own template: chat_template.jinja, else tokenizer_config.json's chat_template (a
// string, or a list of {name, template} of which "default" and "tool_use" are used).
std::optional<JinjaSources> model_jinja(const fs::path& dir) {
  const fs::path file = dir / "chat_template.jinja";
  if (fs::exists(file)) {
    const auto text = read_file(file.string());
    if (!text) throw IoError(fmt::format("{}: cannot read the file", file.string()));
    return JinjaSources{*text, "", file.string()};
  }
  const fs::path cfg = dir / "tokenizer_config.json";
  if (!fs::exists(cfg)) return std::nullopt;
  const json j = read_json(cfg);
  if (!j.is_object() || !j.contains("chat_template") || j["chat_template"].is_null()) return std::nullopt;
  const json& t = j["chat_template"];
  if (t.is_string()) return JinjaSources{t.get<std::string>(), "", cfg.string()};
  if (t.is_array()) {
    JinjaSources s{"", "", cfg.string()};
    std::string names;
    for (const auto& e : t) {
      if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("template") ||
          !e["template"].is_string())
        throw ConfigError(fmt::format("{}: chat_template: each entry of the list needs a string \"name\" and "
                                      "\"template\"", cfg.string()));
      const std::string name = e["name"].get<std::string>();
      names += (names.empty() ? "" : ", ") + name;
      if (name == "default") s.source = e["template"].get<std::string>();
      if (name == "tool_use") s.tool_source = e["template"].get<std::string>();
    }
    if (s.source.empty())
      throw ConfigError(fmt::format("{}: chat_template lists templates named {} and none named \"default\"",
                                    cfg.string(), names.empty() ? std::string("(none)") : names));
    return s;
  }
  throw ConfigError(fmt::format("{}: chat_template must be a string or a list of {{name, template}}", cfg.string()));
}

// What the model's stop tokens write: a turn that ended with one of them has written its end.
std::vector<std::string> stop_texts(const fs::path& dir, const Tokenizer& tok) {
  model::ModelConfig mc;
  if (fs::exists(dir / "config.json")) mc = model::load_model_config(dir.string());
  std::vector<std::string> out;
  for (int64_t id : eos_token_ids(dir.string(), mc, tok)) {
    const std::string t = tok.id_to_token(id);
    if (!t.empty()) out.push_back(t);
  }
  return out;
}

// The marker of the model's turn when a Jinja template's observation turn is found.
// (Not whitespace at its ends: templates trim contents.)
constexpr const char* kTurnMarker = "TILLER_MODEL_TURN_MARKER_7f3a";

}  // namespace

ChatTemplate::ChatTemplate(ChatFormat builtin) : format_(builtin) {
  TILLER_CHECK(builtin != ChatFormat::kJinja, "a Jinja chat template is made with ChatTemplate::jinja");
}

ChatTemplate ChatTemplate::jinja(std::string source, std::string tool_source, std::string variables_json,
                                 std::vector<std::string> stop_texts, std::string origin) {
  auto j = std::make_shared<Jinja>();
  j->source = std::move(source);
  j->tool_source = std::move(tool_source);
  j->variables = variables_json.empty() ? ordered_json::object() : ordered_json::parse(variables_json);
  j->stop_texts = std::move(stop_texts);
  j->origin = std::move(origin);
  ChatTemplate t;
  t.format_ = ChatFormat::kJinja;
  t.jinja_ = std::move(j);
  return t;
}

std::string ChatTemplate::name() const { return format_ == ChatFormat::kJinja ? jinja_->origin : chat_format_name(format_); }

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                 const std::string& tools_json) const {
  if (format_ != ChatFormat::kJinja) {
    if (!tools_json.empty() && format_ != ChatFormat::kNone)
      throw ConfigError(fmt::format("the {} chat format has no place for tools; give the model's own chat template "
                                    "(data.chat_template: model) or a .jinja file",
                                    chat_format_name(format_)));
    return render_builtin(format_, messages, add_generation_prompt);
  }
  ordered_json ctx = jinja_->variables;
  ordered_json msgs = ordered_json::array();
  for (const auto& m : messages) {
    ordered_json o = ordered_json::object();
    o["role"] = m.role;
    o["content"] = m.content;
    if (!m.fields_json.empty()) {
      const ordered_json fields = ordered_json::parse(m.fields_json);
      for (const auto& [k, v] : fields.items()) o[k] = v;
    }
    msgs.push_back(std::move(o));
  }
  ctx["messages"] = std::move(msgs);
  ctx["add_generation_prompt"] = add_generation_prompt;
  ctx["tools"] = tools_json.empty() ? ordered_json() : ordered_json::parse(tools_json);
  ctx["documents"] = ordered_json();
  const std::string& src = !tools_json.empty() && !jinja_->tool_source.empty() ? jinja_->tool_source : jinja_->source;
  try {
    return python::render_jinja(src, ctx.dump());
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", jinja_->origin, e.what()));
  }
}

std::string ChatTemplate::observation_turn(const std::string& text, bool turn_closed, const std::string& role) const {
  if (format_ == ChatFormat::kNone) return text;
  if (format_ != ChatFormat::kJinja) {
    if (format_ == ChatFormat::kChatML)
      return std::string(turn_closed ? "" : "<|im_end|>") + "\n" + render({{role, text}}, /*add_generation_prompt=*/true);
    const std::string t = render({{role, text}}, true);
    return std::string(turn_closed ? "" : "<|eot_id|>") + t.substr(std::string("<|begin_of_text|>").size());
  }
  const std::string whole = render({{"user", "?"}, {"assistant", kTurnMarker}, {role, text}}, true);
  const size_t at = whole.find(kTurnMarker);
  if (at == std::string::npos || whole.find(kTurnMarker, at + 1) != std::string::npos)
    throw ConfigError(fmt::format("{}: the chat template does not write a model's turn as it is, so a multi-turn "
                                  "rollout cannot continue it; use a template that does (data.chat_template)",
                                  jinja_->origin));
  std::string after = whole.substr(at + std::string(kTurnMarker).size());
  if (turn_closed) {
    size_t longest = 0;  // the stop token the turn ended with is in its tokens already
    for (const auto& s : jinja_->stop_texts)
      if (s.size() > longest && after.compare(0, s.size(), s) == 0) longest = s.size();
    after.erase(0, longest);
  }
  return after;
}

namespace {

// The template's variables: the special tokens' names, then data.chat_template_kwargs over them.
ordered_json template_variables(const fs::path& dir, const std::string& kwargs_json) {
  ordered_json vars = special_token_variables(dir);
  if (kwargs_json.empty()) return vars;
  ordered_json kwargs;
  try {
    kwargs = ordered_json::parse(kwargs_json);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("data.chat_template_kwargs (generate: --chat-template-kwargs) = '{}' is not a JSON object: {}", kwargs_json, e.what()));
  }
  if (!kwargs.is_object())
    throw ConfigError(fmt::format("data.chat_template_kwargs (generate: --chat-template-kwargs) = '{}' is not a mapping of names to values", kwargs_json));
  for (const auto& [k, v] : kwargs.items()) {
    if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt")
      throw ConfigError(fmt::format("data.chat_template_kwargs: '{}' is set by tiller for each conversation; remove it",
                                    k));
    vars[k] = v;
  }
  return vars;
}

}  // namespace

ChatTemplate load_chat_template(const std::string& choice, const std::string& model_dir, const Tokenizer& tok,
                                const std::string& kwargs_json) {
  const fs::path dir(model_dir);
  const auto make = [&](const JinjaSources& s) {
    return ChatTemplate::jinja(s.source, s.tool_source, template_variables(dir, kwargs_json).dump(),
                               stop_texts(dir, tok), s.origin);
  };
  // A built-in format has no variables: kwargs for it would change nothing, silently.
  const auto builtin = [&](ChatFormat f) {
    if (!kwargs_json.empty() && f != ChatFormat::kNone)
      throw ConfigError(fmt::format("data.chat_template_kwargs = {} needs a Jinja chat template, and {}'s template is "
                                    "the built-in {} format (data.chat_template = {}); give the model's own or a "
                                    ".jinja file, or drop the kwargs",
                                    kwargs_json, model_dir, chat_format_name(f), choice));
    return ChatTemplate(f);
  };
  if (choice == "auto" || choice == "model") {
    if (auto s = model_jinja(dir)) {
      if (choice == "auto" && !python::available()) {
        const ChatFormat f = parse_chat_format("auto", tok);
        log::warn("{}: this tiller has no embedded Python to render the model's Jinja chat template; the built-in "
                  "{} format is used, which may differ from it (default system prompts, tools): rebuild with "
                  "Python's development files (apt-get install python3-dev) to use the model's own",
                  s->origin, chat_format_name(f));
        return builtin(f);
      }
      return make(*s);
    }
    if (choice == "model")
      throw ConfigError(fmt::format("data.chat_template = model: {} has no chat template (no chat_template.jinja, no "
                                    "chat_template in tokenizer_config.json); give a .jinja file, chatml or llama3",
                                    model_dir));
    return builtin(parse_chat_format("auto", tok));
  }
  if (choice == "none" || choice == "chatml" || choice == "llama3") return builtin(parse_chat_format(choice, tok));
  if (choice.size() > 6 && choice.compare(choice.size() - 6, 6, ".jinja") == 0) {
    const auto text = read_file(choice);
    if (!text) throw ConfigError(fmt::format("data.chat_template = {}: cannot read the file", choice));
    return make({*text, "", choice});
  }
  throw ConfigError(fmt::format("data.chat_template = '{}': use auto, model, chatml, llama3, none or a path to a "
                                ".jinja file", choice));
}

ChatTemplate job_chat_template(const DataConfig& data, const std::string& model_dir, const Tokenizer& tok) {
  return data.apply_chat_template ? load_chat_template(data.chat_template, model_dir, tok, data.chat_template_kwargs)
                                  : ChatTemplate();
}

std::string apply_chat_template(const ChatTemplate& chat, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) {
  return chat.render(messages, add_generation_prompt);
}

std::string observation_turn(const ChatTemplate& chat, const std::string& text, bool turn_closed) {
  return chat.observation_turn(text, turn_closed);
}

std::string apply_input_template(const std::string& input_template, const std::string& input) {
  const size_t at = input_template.find("{}");
  if (at == std::string::npos || input_template.find("{}", at + 2) != std::string::npos)
    throw ConfigError(fmt::format("input_template '{}' must contain exactly one '{{}}' where the input goes", input_template));
  return input_template.substr(0, at) + input + input_template.substr(at + 2);
}

}  // namespace tiller::text
