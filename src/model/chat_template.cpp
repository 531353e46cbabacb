#include "tiller/model/chat_template.h"

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/model/tokenizer.h"

namespace tiller::model {

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
}  // namespace

std::string apply_chat_template(ChatFormat format, const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string out;
  switch (format) {
    case ChatFormat::kNone:
      for (const auto& m : messages) out += m.content;
      return out;
    case ChatFormat::kChatML:
      // Qwen2.5's template: a run of tool messages is one user turn of <tool_response> blocks.
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
      // As Meta's template: BOS once, contents trimmed; a tool's answer is the ipython role's turn.
      out = "<|begin_of_text|>";
      for (const auto& m : messages)
        out += "<|start_header_id|>" + (m.role == "tool" ? std::string("ipython") : m.role) + "<|end_header_id|>\n\n" +
               trim(m.content) + "<|eot_id|>";
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;
  }
  return out;
}

std::string observation_turn(ChatFormat format, const std::string& text, bool turn_closed) {
  switch (format) {
    case ChatFormat::kNone: return text;
    case ChatFormat::kChatML:
      return std::string(turn_closed ? "" : "<|im_end|>") + "\n" +
             apply_chat_template(format, {{"tool", text}}, /*add_generation_prompt=*/true);
    case ChatFormat::kLlama3: {
      std::string t = apply_chat_template(format, {{"tool", text}}, true);
      return std::string(turn_closed ? "" : "<|eot_id|>") + t.substr(std::string("<|begin_of_text|>").size());
    }
  }
  return text;
}

std::string apply_input_template(const std::string& input_template, const std::string& input) {
  const size_t at = input_template.find("{}");
  if (at == std::string::npos || input_template.find("{}", at + 2) != std::string::npos)
    throw ConfigError(fmt::format("input_template '{}' must contain exactly one '{{}}' where the input goes", input_template));
  return input_template.substr(0, at) + input + input_template.substr(at + 2);
}

}  // namespace tiller::model
