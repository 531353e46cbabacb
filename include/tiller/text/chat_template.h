// Prompt templating: a model's chat template — its own Jinja template (tokenizer_config.json's
// `chat_template` or chat_template.jinja, rendered as transformers' apply_chat_template renders
// it) or a built-in format (ChatML, Llama-3) for models that carry none — and OpenRLHF-style input
// templates ("Question: {}\nAnswer:"). The result is text; encode it with add_special_tokens =
// false (the template already carries BOS where the format wants it).
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace tiller {
struct DataConfig;
}

namespace tiller::text {

class Tokenizer;

enum class ChatFormat { kNone, kChatML, kLlama3, kJinja };

struct ChatMessage {
  std::string role;  // system | user | assistant | tool (a tool's or environment's answer)
  std::string content;
  // The message's other keys as a JSON object's text (tool_calls, tool_call_id, name, ...), "" for
  // none. Jinja templates see them; the built-in formats write role and content only.
  std::string fields_json = {};
};

// A conversation's format. Copyable and cheap (the Jinja source is shared); thread-safe to use
// from any thread (Jinja rendering takes the embedded interpreter's GIL).
class ChatTemplate {
 public:
  ChatTemplate() = default;
  ChatTemplate(ChatFormat builtin);  // NOLINT(google-explicit-constructor): kNone, kChatML, kLlama3

  // The model's Jinja template. `tool_source`: the template named "tool_use" (used when tools are
  // given; "" = the default one), `variables_json`: a JSON object of the variables the template
  // sees besides the conversation (bos_token, eos_token, ...), `stop_texts`: the texts of the
  // model's stop tokens (a turn that ended with one does not write it again), `origin`: the file.
  static ChatTemplate jinja(std::string source, std::string tool_source, std::string variables_json,
                            std::vector<std::string> stop_texts, std::string origin);

  bool enabled() const { return format_ != ChatFormat::kNone; }
  ChatFormat format() const { return format_; }
  // "chatml", "llama3", "none", or the Jinja template's file ("models/x/tokenizer_config.json").
  std::string name() const;

  // The conversation as the format writes it; with add_generation_prompt, the opening of the
  // assistant's turn follows. `tools_json`: a JSON list of tool schemas for the template ("" none;
  // the built-in formats refuse tools). kNone concatenates the contents. ConfigError when a Jinja
  // template raises (its own message).
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true,
                     const std::string& tools_json = "") const;

  // What follows a model's turn when a tool or environment answers `text` (multi-turn rollouts):
  // the end of the model's turn unless it ended with its stop token (`turn_closed`), the answer as
  // a message of `role` (tool, or user for templates without a tool role), and the opening of the
  // model's next turn; so prompt + turn + observation_turn(...) is what render writes for the
  // conversation. Built-in formats: ChatML writes a tool's answer as a user turn of
  // <tool_response> (as Qwen2.5's template), Llama-3 as the ipython role. kNone: the text as it is
  // (the environment formats it). A Jinja template's answer is found by rendering a conversation
  // whose model turn is a marker: what the template writes after the marker.
  std::string observation_turn(const std::string& text, bool turn_closed, const std::string& role = "tool") const;

 private:
  struct Jinja;
  ChatFormat format_ = ChatFormat::kNone;
  std::shared_ptr<const Jinja> jinja_;
};

// data.chat_template: "auto" (the model's Jinja template when it has one and this build embeds
// Python, else ChatML or Llama-3 by the tokenizer's special tokens with a warning, else none), "model" (its Jinja template; ConfigError when it
// has none), "chatml", "llama3", "none", or a path to a .jinja file. `model_dir` holds
// tokenizer_config.json, chat_template.jinja and the special tokens' definitions.
// `kwargs_json`: a JSON object of extra variables for a Jinja template (data.chat_template_kwargs,
// e.g. {"enable_thinking": false}), over the special tokens' names as transformers' kwargs are;
// ConfigError when it names one of messages, tools, documents, add_generation_prompt, or when the
// template chosen is a built-in format (which has no variables).
ChatTemplate load_chat_template(const std::string& choice, const std::string& model_dir, const Tokenizer& tok,
                                const std::string& kwargs_json = "");

// A job's template: data.chat_template of `model_dir` when data.apply_chat_template, else none.
ChatTemplate job_chat_template(const DataConfig& data, const std::string& model_dir, const Tokenizer& tok);

// "none", "chatml", "llama3"; "auto" picks by the tokenizer's special tokens (<|im_start|> ->
// ChatML, <|start_header_id|> -> Llama-3, else none). Throws ConfigError for another name.
ChatFormat parse_chat_format(const std::string& name, const Tokenizer& tok);
const char* chat_format_name(ChatFormat f);

// Shorthands of ChatTemplate::render and ::observation_turn.
std::string apply_chat_template(const ChatTemplate& chat, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt = true);
std::string observation_turn(const ChatTemplate& chat, const std::string& text, bool turn_closed);

// Replaces the single "{}" in `input_template` with `input`; ConfigError unless there is exactly one.
std::string apply_input_template(const std::string& input_template, const std::string& input);

}  // namespace tiller::text
