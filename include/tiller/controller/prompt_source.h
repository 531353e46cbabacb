// Where a job's prompts come from, by name (data.source), in a registry (tiller/core/registry.h;
// docs/library.md). Built in, through the same registry: file (data.prompts: a JSONL or parquet
// file, tiller/data/prompt_dataset.h). A trainer of one's own registers a source that makes its
// prompts as it goes: generated tasks, a curriculum, a stream from elsewhere; its factory reads
// data.source_args (a string of its own format).
//
// The controller draws prompts with next() and reads them back with at() while their samples are
// generated, scored and recorded. at(i) must answer for every index next() has returned in this
// run, and, after a resume, for the indices the checkpointed run drew (the prompts in flight at the
// checkpoint are sent again): a generator makes prompt i from (run.seed, i). cursor() is what a
// checkpoint keeps, seek() where a resumed run starts.
//
// Threading: the controller's thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tiller/core/config.h"
#include "tiller/core/registry_api.h"
#include "tiller/data/prompt_dataset.h"

namespace tiller::text {
class Tokenizer;
}  // namespace tiller::text

namespace tiller::controller {

class PromptSource {
 public:
  virtual ~PromptSource() = default;
  virtual int64_t next() = 0;  // the next prompt's index (the cursor moves)
  virtual const data::Prompt& at(int64_t index) const = 0;
  virtual data::DatasetCursor cursor() const = 0;
  virtual void seek(const data::DatasetCursor& c) = 0;
  // Distinct prompts, so that a resume with other data is refused; -1: not a fixed set.
  virtual int64_t size() const { return -1; }
};

struct PromptSourceContext {
  const JobConfig* job = nullptr;
  const text::Tokenizer* tokenizer = nullptr;
  // A prompt made as the file source makes one: `text` through data.input_template and the chat
  // template (data.apply_chat_template), encoded without special tokens, with `label`; a
  // ConfigError when it is longer than rollout.max_prompt_tokens.
  std::function<data::Prompt(const std::string& text, const std::string& label)> make_prompt;
};

struct PromptSourceDef {
  // Makes the job's source (on the controller, once); throws ConfigError for settings it cannot use.
  std::function<std::unique_ptr<PromptSource>(const PromptSourceContext&)> make;
  std::string summary;  // one line
};

// A ConfigError for an invalid name, one registered already, or no factory.
// find_prompt_source: the source registered as `name`; a ConfigError naming data.source, the registered names and
// the closest one otherwise.
TILLER_REGISTRY_API(prompt_source, PromptSourceDef);
// The lookup's old name, for one release.
inline const PromptSourceDef& prompt_source(const std::string& name) { return find_prompt_source(name); }

// The job's source (data.source), made with the job's tokenizer.
std::unique_ptr<PromptSource> make_job_prompt_source(const JobConfig& job, const text::Tokenizer& tokenizer);

// The data.* settings as a prompt dataset's options (keys, templates, the chat template, length
// policy, order): the file source's, and evaluation's (eval.prompts).
data::DatasetOptions job_dataset_options(const JobConfig& job, const text::Tokenizer& tokenizer);

}  // namespace tiller::controller
