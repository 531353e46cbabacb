#include "tiller/rollout/prompt_dataset.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/checked_math.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/model/tokenizer.h"

namespace tiller::rollout {

LongPromptPolicy parse_long_prompt_policy(const std::string& name) {
  if (name == "skip") return LongPromptPolicy::kSkip;
  if (name == "truncate_left") return LongPromptPolicy::kTruncateLeft;
  if (name == "error") return LongPromptPolicy::kError;
  throw ConfigError(fmt::format("long prompt policy '{}': use skip, truncate_left or error", name));
}

PromptDataset::PromptDataset(const std::string& path, const model::Tokenizer& tok, const DatasetOptions& o)
    : opts_(o) {
  if (o.max_prompt_tokens < 1) throw ConfigError(fmt::format("{}: max_prompt_tokens must be >= 1", path));
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw ConfigError(fmt::format("{}: cannot open the prompt file: {}", path, std::strerror(errno)));
  if (S_ISDIR(st.st_mode))
    throw ConfigError(fmt::format("{}: is a directory, not a JSONL file of prompts; set data.prompts to the file", path));
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
    throw ConfigError(fmt::format("{}: is not a regular file; set data.prompts to a JSONL file of prompts", path));
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the prompt file", path));
  const int64_t per_token = tok.max_bytes_per_token();
  const int64_t byte_limit = per_token > 0 ? checked_mul(o.max_prompt_tokens, per_token, "max_prompt_tokens x bytes per token") : 0;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (o.max_samples > 0 && size() >= o.max_samples) break;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are allowed
    auto bad = [&](const std::string& what) { throw ConfigError(fmt::format("{}:{}: {}", path, n, what)); };
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      bad(fmt::format("not valid JSON ({})", e.what()));
    }
    if (!j.is_object()) bad("not a JSON object");
    if (!j.contains(o.input_key) || !j[o.input_key].is_string())
      bad(fmt::format("no string under the input key '{}' (data.input_key)", o.input_key));
    Prompt p;
    p.line = n;
    p.text = j[o.input_key].get<std::string>();
    if (j.contains(o.label_key)) {
      const auto& l = j[o.label_key];
      if (l.is_string()) p.label = l.get<std::string>();
      else if (l.is_number()) p.label = l.dump();
      else bad(fmt::format("the label under '{}' is neither a string nor a number", o.label_key));
    }
    if (!o.input_template.empty()) p.text = model::apply_input_template(o.input_template, p.text);
    if (o.chat != model::ChatFormat::kNone) p.text = model::apply_chat_template(o.chat, {{"user", p.text}});
    // A prompt too long in bytes to fit max_prompt_tokens is over the limit without encoding it,
    // so one huge line costs the skip and error policies a length check (truncate_left keeps
    // its last tokens and has to encode it).
    std::string what;
    if (o.long_prompts != LongPromptPolicy::kTruncateLeft && byte_limit > 0 &&
        static_cast<int64_t>(p.text.size()) > byte_limit) {
      what = fmt::format("the prompt has {} bytes, over what max_prompt_tokens {} can hold (a token is at most {} bytes)",
                         p.text.size(), o.max_prompt_tokens, per_token);
    } else {
      p.tokens = tok.encode(p.text, /*add_special_tokens=*/false);
      if (p.tokens.empty()) bad("the prompt is empty after templating");
      if (static_cast<int64_t>(p.tokens.size()) > o.max_prompt_tokens)
        what = fmt::format("the prompt has {} tokens, over max_prompt_tokens {}", p.tokens.size(), o.max_prompt_tokens);
    }
    if (!what.empty()) {
      if (o.long_prompts == LongPromptPolicy::kError) bad(what + " (the policy is error)");
      if (o.long_prompts == LongPromptPolicy::kSkip) {
        if (skipped_++ == 0) log::warn("{}:{}: {}; skipped (and so is every other such prompt)", path, n, what);
        continue;
      }
      p.tokens.erase(p.tokens.begin(), p.tokens.end() - o.max_prompt_tokens);
      ++truncated_;
    }
    prompts_.push_back(std::move(p));
  }
  if (in.bad()) throw IoError(fmt::format("{}: read error after line {}: {}", path, n, std::strerror(errno)));
  if (prompts_.empty())
    throw ConfigError(fmt::format("{}: no prompt left ({} lines read, {} over max_prompt_tokens {})", path, n,
                                  skipped_, o.max_prompt_tokens));
  if (skipped_ > 0) log::warn("{}: {} of {} prompts skipped as too long", path, skipped_, skipped_ + size());
  order_epoch();
}

void PromptDataset::order_epoch() {
  order_.resize(prompts_.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int64_t>(i);
  if (!opts_.shuffle) return;
  // Fisher-Yates with mt19937_64 (fully specified by the standard, unlike std::shuffle).
  std::mt19937_64 gen(opts_.seed * 1000003ull + static_cast<uint64_t>(cursor_.epoch));
  for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[gen() % i]);
}

std::vector<int64_t> PromptDataset::next(int64_t n) {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  while (static_cast<int64_t>(out.size()) < n) {
    if (cursor_.position == size()) {
      ++cursor_.epoch;
      cursor_.position = 0;
      order_epoch();
    }
    out.push_back(order_[static_cast<size_t>(cursor_.position++)]);
  }
  return out;
}

void PromptDataset::seek(const DatasetCursor& c) {
  if (c.epoch < 0 || c.position < 0 || c.position > size())
    throw ConfigError(fmt::format("dataset cursor (epoch {}, position {}) is outside the dataset of {} prompts",
                                  c.epoch, c.position, size()));
  cursor_ = c;
  order_epoch();
}

}  // namespace tiller::rollout
