#include "tiller/controller/prompt_source.h"

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/core/registry.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"

namespace tiller::controller {
namespace {

text::ChatTemplate job_chat(const JobConfig& cfg, const text::Tokenizer& tok) {
  return text::job_chat_template(cfg.data, cfg.roles.actor.model, tok);
}

// data.source file: the JSONL or parquet file of data.prompts, read once, served in epochs.
class FilePrompts final : public PromptSource {
 public:
  FilePrompts(const JobConfig& cfg, const text::Tokenizer& tok) : dataset_(open(cfg, tok)) {
    if (dataset_.skipped() > 0)
      log::warn("data: {} of {} prompts are longer than rollout.max_prompt_tokens = {} and are skipped "
                "(data.long_prompt_policy = skip)",
                dataset_.skipped(), dataset_.skipped() + dataset_.size(), cfg.rollout.max_prompt_tokens);
  }
  int64_t next() override { return dataset_.next(1).at(0); }
  const data::Prompt& at(int64_t index) const override { return dataset_.at(index); }
  data::DatasetCursor cursor() const override { return dataset_.cursor(); }
  void seek(const data::DatasetCursor& c) override { dataset_.seek(c); }
  int64_t size() const override { return dataset_.size(); }

 private:
  static data::PromptDataset open(const JobConfig& cfg, const text::Tokenizer& tok) {
    if (cfg.data.prompts.empty()) throw ConfigError("data.prompts: set the file of prompts (JSONL or parquet)");
    return data::PromptDataset(cfg.data.prompts, tok, job_dataset_options(cfg, tok));
  }
  data::PromptDataset dataset_;
};

Registry<PromptSourceDef>& sources() {
  static Registry<PromptSourceDef>* r = [] {
    auto* reg = new Registry<PromptSourceDef>(
        "prompt source", [](const PromptSourceDef& d) { return d.make ? "" : "no factory (make)"; });
    reg->add("file", {[](const PromptSourceContext& c) -> std::unique_ptr<PromptSource> {
                        return std::make_unique<FilePrompts>(*c.job, *c.tokenizer);
                      },
                      "the JSONL or parquet file of data.prompts"});
    return reg;
  }();
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(prompt_source, PromptSourceDef, sources, "data.source")

data::DatasetOptions job_dataset_options(const JobConfig& cfg, const text::Tokenizer& tok) {
  data::DatasetOptions d;
  d.input_key = cfg.data.input_key;
  d.label_key = cfg.data.label_key;
  d.data_source_key = cfg.data.data_source_key;
  d.extra_info_key = cfg.data.extra_info_key;
  d.tools_key = cfg.data.tools_key;
  d.input_template = cfg.data.input_template;
  d.chat = job_chat(cfg, tok);
  d.max_prompt_tokens = cfg.rollout.max_prompt_tokens;
  d.long_prompts = cfg.data.long_prompt_policy;
  d.shuffle = cfg.data.shuffle;
  d.seed = static_cast<uint64_t>(cfg.run.seed);
  d.max_samples = cfg.data.max_samples;
  return d;
}

std::unique_ptr<PromptSource> make_job_prompt_source(const JobConfig& job, const text::Tokenizer& tokenizer) {
  const PromptSourceDef& def = find_prompt_source(job.data.source);
  PromptSourceContext ctx;
  ctx.job = &job;
  ctx.tokenizer = &tokenizer;
  const text::ChatTemplate chat = job_chat(job, tokenizer);
  ctx.make_prompt = [&job, &tokenizer, chat](const std::string& text, const std::string& label) {
    data::Prompt p;
    p.text = text;
    if (!job.data.input_template.empty()) p.text = text::apply_input_template(job.data.input_template, p.text);
    p.input = p.text;
    if (chat.enabled()) p.text = chat.render({{"user", p.text}});
    p.tokens = tokenizer.encode(p.text, /*add_special_tokens=*/false);
    p.label = label;
    if (static_cast<int64_t>(p.tokens.size()) > job.rollout.max_prompt_tokens)
      throw ConfigError(fmt::format("data.source = {}: a prompt of {} tokens, over rollout.max_prompt_tokens = {}: "
                                    "'{}'",
                                    job.data.source, p.tokens.size(), job.rollout.max_prompt_tokens,
                                    text.substr(0, 60)));
    return p;
  };
  std::unique_ptr<PromptSource> s = def.make(ctx);
  if (!s) throw ConfigError(fmt::format("prompt source '{}': its factory returned no source", job.data.source));
  return s;
}

}  // namespace tiller::controller
