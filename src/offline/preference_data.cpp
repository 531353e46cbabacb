#include "offline/preference_data.h"

#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/records.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::offline {
namespace {

// Chat messages under `key` in `j` (a list of {"role", "content", ...}).
std::vector<text::ChatMessage> messages_of(const std::string& where, const nlohmann::ordered_json& list, const std::string& key) {
  return data::chat_messages(where, list, key);
}

// One side of a pair: the prompt (text, messages, or none) and the response under `key`.
SftSample side(const std::string& where, const nlohmann::ordered_json* prompt, const nlohmann::ordered_json& j, const std::string& key,
               const text::Tokenizer& tok, const PreferenceDataOptions& o) {
  const nlohmann::ordered_json* r = data::lookup(j, key);
  if (r == nullptr || !(r->is_string() || r->is_array()))
    throw ConfigError(fmt::format("{}: no response under '{}' (text or a list of chat messages)", where, key));
  if (prompt != nullptr && prompt->is_string() && r->is_string()) {
    SftDataOptions so;
    so.input_template = o.input_template;
    so.chat = o.chat;
    so.eos_id = o.eos_id;
    return encode_pair(where, prompt->get<std::string>(), r->get<std::string>(), tok, so);
  }
  std::vector<text::ChatMessage> conversation;
  if (prompt != nullptr) {
    if (prompt->is_string()) {
      const std::string p = prompt->get<std::string>();
      conversation.push_back({"user", o.input_template.empty() ? p : text::apply_input_template(o.input_template, p)});
    } else {
      conversation = messages_of(where, *prompt, o.prompt_key);
    }
  }
  const size_t first = conversation.size();
  if (r->is_string()) {
    conversation.push_back({"assistant", r->get<std::string>()});
  } else {
    const std::vector<text::ChatMessage> turns = messages_of(where, *r, key);
    conversation.insert(conversation.end(), turns.begin(), turns.end());
  }
  return encode_conversation(where + " (" + key + ")", conversation, tok, o.chat, first);
}

}  // namespace

PreferenceDataset::PreferenceDataset(const std::string& path, const text::Tokenizer& tok,
                                     const PreferenceDataOptions& o) {
  if (o.max_tokens < 2) throw ConfigError(fmt::format("{}: max_tokens must be >= 2", path));
  const int64_t n = data::for_each_record(
      path, "the preference data file", o.path_key,
      [&](const std::string& where, int64_t number, const nlohmann::ordered_json& j) {
        if (o.max_samples > 0 && size() >= o.max_samples) return false;
        const nlohmann::ordered_json* prompt = data::lookup(j, o.prompt_key);
        if (prompt != nullptr && prompt->is_null()) prompt = nullptr;
        if (prompt != nullptr && !prompt->is_string() && !prompt->is_array())
          throw ConfigError(fmt::format("{}: the prompt under '{}' is neither text nor a list of chat messages", where,
                                        o.prompt_key));
        PreferencePair p;
        p.line = number;
        p.chosen = side(where, prompt, j, o.chosen_key, tok, o);
        p.rejected = side(where, prompt, j, o.rejected_key, tok, o);
        p.chosen.line = p.rejected.line = number;
        if (const nlohmann::ordered_json* m = data::lookup(j, o.margin_key); m != nullptr && !m->is_null()) {
          if (!m->is_number() || !std::isfinite(m->get<double>()))
            throw ConfigError(fmt::format("{}: the margin under '{}' is not a finite number", where, o.margin_key));
          p.margin = m->get<double>();
          margins_ = true;
        }
        const bool keep_c = apply_length_policy(where + " (" + o.chosen_key + ")", p.chosen, o.max_tokens,
                                                o.long_samples, long_sides_, truncated_);
        const bool keep_r = keep_c && apply_length_policy(where + " (" + o.rejected_key + ")", p.rejected,
                                                          o.max_tokens, o.long_samples, long_sides_, truncated_);
        if (!keep_c || !keep_r) {
          ++skipped_;
          return true;
        }
        pairs_.push_back(std::move(p));
        return true;
      });
  if (pairs_.empty())
    throw ConfigError(fmt::format("{}: no pair left ({} records read, {} with a side over max_tokens {})", path, n,
                                  skipped_, o.max_tokens));
  if (skipped_ > 0) log::warn("{}: {} of {} pairs left out as too long", path, skipped_, skipped_ + size());
}

SftDataset::Split PreferenceDataset::split(int64_t eval, uint64_t seed) const { return held_out_split(size(), eval, seed); }

}  // namespace tiller::offline
