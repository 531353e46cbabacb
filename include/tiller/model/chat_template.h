// Prompt templating: the ChatML (Qwen) and Llama-3 chat formats, and OpenRLHF-style input
// templates ("Question: {}\nAnswer:"). The result is text; encode it with
// add_special_tokens = false (the template already carries BOS where the format wants it).
#pragma once

#include <string>
#include <vector>

namespace tiller::model {

class Tokenizer;

enum class ChatFormat { kNone, kChatML, kLlama3 };

struct ChatMessage {
  std::string role;  // system | user | assistant | tool (a tool's or environment's answer)
  std::string content;
};

// "none", "chatml", "llama3"; "auto" picks by the tokenizer's special tokens (<|im_start|> ->
// ChatML, <|start_header_id|> -> Llama-3, else none). Throws ConfigError for another name.
ChatFormat parse_chat_format(const std::string& name, const Tokenizer& tok);
const char* chat_format_name(ChatFormat f);

// The conversation as the format writes it; with add_generation_prompt, the opening of the
// assistant's turn follows. kNone concatenates the contents.
std::string apply_chat_template(ChatFormat format, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt = true);

// What follows a model's turn when a tool or environment answers `text` (multi-turn rollouts):
// the end of the model's turn unless it ended with its stop token (`turn_closed`), the tool turn
// (ChatML: a user turn of <tool_response>, as Qwen2.5's template; Llama-3: the ipython role), and
// the opening of the model's next turn. kNone: the text as it is (the environment formats it). So
// prompt + turn + observation_turn(...) is what apply_chat_template writes for the conversation.
std::string observation_turn(ChatFormat format, const std::string& text, bool turn_closed);

// Replaces the single "{}" in `input_template` with `input`; ConfigError unless there is exactly one.
std::string apply_input_template(const std::string& input_template, const std::string& input);

}  // namespace tiller::model
