#include "offline/sft_data.h"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/records.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/text/tokenizer.h"
#include "tiller/data/epoch_order.h"

namespace tiller::offline {
namespace {

bool known_role(const std::string& r) { return r == "system" || r == "user" || r == "assistant" || r == "tool"; }

// Appends `text`'s tokens with mask value `trained`.
void append(SftSample& s, const text::Tokenizer& tok, const std::string& text, uint8_t trained) {
  if (text.empty()) return;
  const std::vector<int64_t> ids = tok.encode(text, /*add_special_tokens=*/false);
  s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
  s.loss_mask.insert(s.loss_mask.end(), ids.size(), trained);
}

// `longer` minus its prefix `shorter`; ConfigError when it does not start with it.
std::string extension(const std::string& where, const std::string& shorter, const std::string& longer, size_t turn) {
  if (longer.compare(0, shorter.size(), shorter) != 0)
    throw ConfigError(fmt::format("{}: the chat template does not extend the conversation turn by turn at turn {}; "
                                  "its tokens cannot be masked per turn",
                                  where, turn + 1));
  return longer.substr(shorter.size());
}

}  // namespace

bool apply_length_policy(const std::string& where, SftSample& s, int64_t max_tokens, LongSamples policy,
                         int64_t& skipped, int64_t& truncated) {
  if (static_cast<int64_t>(s.tokens.size()) > max_tokens) {
    const std::string what = fmt::format("the sample has {} tokens, over max_tokens {}", s.tokens.size(), max_tokens);
    if (policy == LongSamples::kError) throw ConfigError(fmt::format("{}: {} (the policy is error)", where, what));
    if (policy == LongSamples::kSkip) {
      if (skipped++ == 0) log::warn("{}: {}; skipped (and so is every other such sample)", where, what);
      return false;
    }
    s.tokens.resize(static_cast<size_t>(max_tokens));
    s.loss_mask.resize(static_cast<size_t>(max_tokens));
    ++truncated;
  }
  if (s.trained() == 0) {  // truncated before its first trained token
    ++skipped;
    return false;
  }
  return true;
}

int64_t SftSample::trained() const {
  int64_t n = 0;
  for (uint8_t m : loss_mask) n += m;
  return n;
}

SftSample encode_conversation(const std::string& where, const std::vector<text::ChatMessage>& messages,
                              const text::Tokenizer& tok, const text::ChatTemplate& chat, size_t first_trained,
                              const std::string& tools_json) {
  if (!chat.enabled())
    throw ConfigError(fmt::format("{}: a conversation of chat messages needs a chat template; set "
                                  "data.apply_chat_template: true",
                                  where));
  if (!tools_json.empty() && chat.format() != text::ChatFormat::kJinja)
    throw ConfigError(fmt::format("{}: the record has tools, and the {} chat format has no place for them; use the "
                                  "model's own template (data.chat_template: model) or a .jinja file",
                                  where, text::chat_format_name(chat.format())));
  bool assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!known_role(messages[i].role))
      throw ConfigError(fmt::format("{}: message {} has the role '{}'; use system, user, assistant or tool", where, i + 1,
                                    messages[i].role));
    assistant = assistant || (messages[i].role == "assistant" && i >= first_trained);
  }
  if (!assistant) throw ConfigError(fmt::format("{}: the conversation has no assistant turn: nothing to train", where));
  SftSample s;
  std::vector<text::ChatMessage> upto;
  // Each message's text is what the template writes for the conversation up to it beyond what it
  // wrote up to the message before (the first one's includes what the template opens with).
  std::string before;
  for (size_t i = 0; i < messages.size(); ++i) {
    const text::ChatMessage& m = messages[i];
    if (m.role == "assistant") {
      const std::string opened = upto.empty() ? std::string() : chat.render(upto, true, tools_json);
      append(s, tok, extension(where, before, opened, i), 0);  // the assistant's header
      before = opened;
    }
    upto.push_back(m);
    const std::string after = chat.render(upto, false, tools_json);
    append(s, tok, extension(where, before, after, i), m.role == "assistant" && i >= first_trained ? 1 : 0);
    before = after;
  }
  if (!s.loss_mask.empty()) s.loss_mask[0] = 0;  // the first token has no token before it
  return s;
}

SftSample encode_pair(const std::string& where, const std::string& prompt, const std::string& response,
                      const text::Tokenizer& tok, const SftDataOptions& o, const std::string& tools_json) {
  const std::string p = o.input_template.empty() ? prompt : text::apply_input_template(o.input_template, prompt);
  if (o.chat.enabled())
    return encode_conversation(where, {{"user", p}, {"assistant", response}}, tok, o.chat, 0, tools_json);
  if (!tools_json.empty())
    throw ConfigError(fmt::format("{}: the record has tools, which only a chat template can write; set "
                                  "data.apply_chat_template: true",
                                  where));
  if (!o.eos_id)
    throw ConfigError(fmt::format("{}: without a chat template a response ends with the tokenizer's EOS token, and "
                                  "this tokenizer has none (tokenizer_config.json's eos_token)",
                                  where));
  SftSample s;
  append(s, tok, p, 0);
  append(s, tok, response, 1);
  s.tokens.push_back(*o.eos_id);
  s.loss_mask.push_back(1);
  if (!s.loss_mask.empty()) s.loss_mask[0] = 0;
  return s;
}

SftDataset::SftDataset(const std::string& path, const text::Tokenizer& tok, const SftDataOptions& o) {
  if (o.max_tokens < 2) throw ConfigError(fmt::format("{}: max_tokens must be >= 2", path));
  const int64_t n = data::for_each_record(
      path, "the SFT data file", o.path_key, [&](const std::string& where, int64_t number, const nlohmann::ordered_json& j) {
        if (o.max_samples > 0 && size() >= o.max_samples) return false;
        auto bad = [&](const std::string& what) { throw ConfigError(fmt::format("{}: {}", where, what)); };
        SftSample s;
        std::string tools;
        if (const nlohmann::ordered_json* t = data::lookup(j, o.tools_key); t != nullptr && !t->is_null()) {
          if (!t->is_array()) bad(fmt::format("'{}' must be a list of tool schemas, not {}", o.tools_key, t->type_name()));
          if (!t->empty()) tools = t->dump();
        }
        if (const nlohmann::ordered_json* msgs = data::lookup(j, o.messages_key); msgs != nullptr && !msgs->is_null()) {
          s = encode_conversation(where, data::chat_messages(where, *msgs, o.messages_key), tok, o.chat, 0, tools);
        } else {
          const nlohmann::ordered_json* p = data::lookup(j, o.prompt_key);
          const nlohmann::ordered_json* r = data::lookup(j, o.response_key);
          if (p == nullptr || r == nullptr || !p->is_string() || !r->is_string())
            bad(fmt::format("neither chat messages under '{}' nor text under '{}' and '{}'", o.messages_key,
                            o.prompt_key, o.response_key));
          s = encode_pair(where, p->get<std::string>(), r->get<std::string>(), tok, o, tools);
        }
        s.line = number;
        if (!apply_length_policy(where, s, o.max_tokens, o.long_samples, skipped_, truncated_)) return true;
        samples_.push_back(std::move(s));
        return true;
      });
  if (samples_.empty())
    throw ConfigError(fmt::format("{}: no sample left ({} records read, {} over max_tokens {})", path, n, skipped_,
                                  o.max_tokens));
  if (skipped_ > 0) log::warn("{}: {} of {} samples left out as too long", path, skipped_, skipped_ + size());
}

HeldOutSplit held_out_split(int64_t n, int64_t eval, uint64_t seed) {
  if (eval < 0 || eval >= n)
    throw ConfigError(fmt::format("a held-out split of {} samples out of {}: keep at least one for training", eval, n));
  const std::vector<int64_t> order = data::shuffled_indices(n, seed * 1000003ull + 17);
  HeldOutSplit s;
  s.eval.assign(order.begin(), order.begin() + eval);
  s.train.assign(order.begin() + eval, order.end());
  std::sort(s.eval.begin(), s.eval.end());
  std::sort(s.train.begin(), s.train.end());
  return s;
}

}  // namespace tiller::offline
