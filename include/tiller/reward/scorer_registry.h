// Batch scorers by name: what scores the samples of a job whose reward.type is remote, python or
// scorer, made by a factory from the job's config, in a registry (tiller/core/registry.h;
// docs/library.md). Built in, through the same registry: remote (the reward service,
// reward.remote_*) and python (reward.python_*). A trainer of one's own registers more before
// tiller::run_main and selects one with reward.type: scorer, reward.scorer: NAME; its factory reads
// reward.scorer_args (a string of its own format: a path, JSON, key=value pairs) and
// reward.scorer_batch_size / reward.scorer_concurrency from the config.
//
// A scorer is a BatchScorer (tiller/reward/batched_reward.h): it gets batches of finished samples
// (prompt and response text, label, data source, extra info, finish reason) on worker threads
// while generation goes on, and returns one finite score per sample, and named extras that are
// logged as reward/extra/<name>.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tiller/core/config.h"
#include "tiller/core/registry_api.h"
#include "tiller/reward/batched_reward.h"

namespace tiller::reward {

struct ScorerSetup {
  std::shared_ptr<BatchScorer> scorer;
  int batch_size = 1;   // samples per batch: 1 to 4096
  int concurrency = 1;  // batches scored at once: 1 to 4096
};

struct BatchScorerDef {
  // Makes the job's scorer (on the controller, once, before the first step); throws ConfigError
  // for settings it cannot use.
  std::function<ScorerSetup(const JobConfig&)> make;
  std::string summary;  // one line
};

// A ConfigError for an invalid name, one registered already, or no factory.
// find_batch_scorer: the scorer registered as `name`; a ConfigError naming reward.scorer, the registered names and
// the closest one otherwise.
TILLER_REGISTRY_API(batch_scorer, BatchScorerDef);
// The lookup's old name, for one release.
inline const BatchScorerDef& batch_scorer(const std::string& name) { return find_batch_scorer(name); }

// The batch scorer a job's reward uses: "remote", "python", reward.scorer (reward.type scorer), or
// "" (rule, model and env rewards are not batch scorers).
std::string job_batch_scorer(const JobConfig& job);
// The job's scorer made and checked: a ConfigError naming the scorer when its factory returns no
// scorer or sizes out of range.
ScorerSetup make_job_batch_scorer(const JobConfig& job);

}  // namespace tiller::reward
