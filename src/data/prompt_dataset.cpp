#include "tiller/data/prompt_dataset.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/records.h"
#include "tiller/core/checked_math.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/text/tokenizer.h"

namespace tiller::data {
namespace {
Prompt parse_prompt(const std::string& where, int64_t number, const nlohmann::ordered_json& j, const DatasetOptions& o);
}  // namespace

PromptDataset::PromptDataset(const std::string& path, const text::Tokenizer& tok, const DatasetOptions& o)
    : opts_(o) {
  if (o.max_prompt_tokens < 1) throw ConfigError(fmt::format("{}: max_prompt_tokens must be >= 1", path));
  const int64_t per_token = tok.max_bytes_per_token();
  byte_limit_ = per_token > 0 ? checked_mul(o.max_prompt_tokens, per_token, "max_prompt_tokens x bytes per token") : 0;
  bytes_per_token_ = per_token;
  const int64_t n = for_each_record(path, "the prompt file", "data.prompts",
                                    [&](const std::string& where, int64_t number, const nlohmann::ordered_json& j) {
                                      if (o.max_samples > 0 && size() >= o.max_samples) return false;
                                      add_prompt(where, parse_prompt(where, number, j, o), tok);
                                      return true;
                                    });
  if (prompts_.empty())
    throw ConfigError(fmt::format("{}: no prompt left ({} records read, {} over max_prompt_tokens {})", path, n,
                                  skipped_, o.max_prompt_tokens));
  if (skipped_ > 0) log::warn("{}: {} of {} prompts skipped as too long", path, skipped_, skipped_ + size());
  order_ = EpochOrder(size(), o.shuffle, o.seed);
}

namespace {

// A record's prompt: its text through the templates, label, data source and extra info (not yet
// tokenized). ConfigError naming `where` for a record without a usable prompt.
Prompt parse_prompt(const std::string& where, int64_t number, const nlohmann::ordered_json& j, const DatasetOptions& o) {
  auto bad = [&](const std::string& what) { throw ConfigError(fmt::format("{}: {}", where, what)); };
  Prompt p;
  p.line = number;
  const nlohmann::ordered_json* input = lookup(j, o.input_key);
  // A prompt's tools (a JSON list of schemas) go to the chat template.
  std::string tools;
  if (const nlohmann::ordered_json* t = o.tools_key.empty() ? nullptr : lookup(j, o.tools_key); t != nullptr && !t->is_null()) {
    if (!t->is_array()) bad(fmt::format("the tools under '{}' (data.tools_key) must be a list of schemas", o.tools_key));
    if (!o.chat.enabled())
      bad(fmt::format("the prompt has tools under '{}'; they go to the chat template: set data.apply_chat_template: "
                      "true (or data.tools_key: \"\" to ignore them)",
                      o.tools_key));
    tools = t->dump();
  }
  const auto render = [&](const std::vector<text::ChatMessage>& messages) {
    try {
      return o.chat.render(messages, true, tools);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{}: {}", where, e.what()));
    }
  };
  if (input != nullptr && input->is_string()) {
    p.text = input->get<std::string>();
    if (!o.input_template.empty()) p.text = text::apply_input_template(o.input_template, p.text);
    p.input = p.text;
    if (o.chat.enabled()) p.text = render({{"user", p.text}});
  } else if (input != nullptr && input->is_array()) {
    // Chat messages, as verl's datasets carry them: [{"role": "user", "content": "..."}, ...]; their
    // other keys (tool_calls, name, ...) go to the chat template too.
    const std::vector<text::ChatMessage> messages = chat_messages(where, *input, o.input_key);
    if (!o.chat.enabled())
      bad(fmt::format("the prompt under '{}' is a list of chat messages; set data.apply_chat_template: true", o.input_key));
    if (!o.input_template.empty())
      bad(fmt::format("data.input_template applies to prompts that are text, and the prompt under '{}' is chat "
                      "messages; leave data.input_template empty", o.input_key));
    p.text = render(messages);
    p.input = input->dump();
  } else {
    bad(fmt::format("no text or list of chat messages under the input key '{}' (data.input_key)", o.input_key));
  }
  if (const nlohmann::ordered_json* l = lookup(j, o.label_key); l != nullptr && !l->is_null()) {
    if (l->is_string()) {
      p.label = l->get<std::string>();
    } else {
      p.label = l->dump();
      p.label_is_json = true;
    }
  }
  if (const nlohmann::ordered_json* d = lookup(j, o.data_source_key); d != nullptr && !d->is_null()) {
    if (!d->is_string()) bad(fmt::format("the data source under '{}' (data.data_source_key) is not text", o.data_source_key));
    p.data_source = d->get<std::string>();
  }
  if (const nlohmann::ordered_json* e = lookup(j, o.extra_info_key); e != nullptr && !e->is_null()) p.extra_info = e->dump();
  return p;
}

}  // namespace

void PromptDataset::add_prompt(const std::string& where, Prompt p, const text::Tokenizer& tok) {
  const DatasetOptions& o = opts_;
  auto bad = [&](const std::string& what) { throw ConfigError(fmt::format("{}: {}", where, what)); };
  // A prompt too long in bytes to fit max_prompt_tokens is over the limit without encoding it,
  // so one huge line costs the skip and error policies a length check (truncate_left keeps
  // its last tokens and has to encode it).
  std::string what;
  if (o.long_prompts != LongPromptPolicy::kTruncateLeft && byte_limit_ > 0 &&
      static_cast<int64_t>(p.text.size()) > byte_limit_) {
    what = fmt::format("the prompt has {} bytes, over what max_prompt_tokens {} can hold (a token is at most {} bytes)",
                       p.text.size(), o.max_prompt_tokens, bytes_per_token_);
  } else {
    p.tokens = tok.encode(p.text, /*add_special_tokens=*/false);
    if (p.tokens.empty()) bad("the prompt is empty after templating");
    if (static_cast<int64_t>(p.tokens.size()) > o.max_prompt_tokens)
      what = fmt::format("the prompt has {} tokens, over max_prompt_tokens {}", p.tokens.size(), o.max_prompt_tokens);
  }
  if (!what.empty()) {
    if (o.long_prompts == LongPromptPolicy::kError) bad(what + " (the policy is error)");
    if (o.long_prompts == LongPromptPolicy::kSkip) {
      if (skipped_++ == 0) log::warn("{}: {}; skipped (and so is every other such prompt)", where, what);
      return;
    }
    p.tokens.erase(p.tokens.begin(), p.tokens.end() - o.max_prompt_tokens);
    ++truncated_;
  }
  prompts_.push_back(std::move(p));
}

std::vector<int64_t> PromptDataset::next(int64_t n) { return order_.next(n); }

}  // namespace tiller::data
