#include "tiller/reward/scorer_registry.h"

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/core/registry.h"
#include "tiller/core/tls.h"
#include "tiller/reward/python_reward.h"
#include "tiller/reward/remote_reward.h"

namespace tiller::reward {
namespace {

// reward.type remote: the reward service, checked for health before the first step.
ScorerSetup make_remote(const JobConfig& cfg) {
  RemoteOptions ro;
  ro.address = cfg.reward.remote_address;
  ro.timeout_seconds = cfg.reward.remote_timeout_s;
  ro.retries = static_cast<int>(cfg.reward.remote_retries);
  ro.batch_size = static_cast<int>(cfg.reward.remote_batch_size);
  ro.concurrency = static_cast<int>(cfg.reward.remote_concurrency);
  if (!cfg.reward.remote_token_file.empty())
    ro.token = read_secret_file(cfg.reward.remote_token_file, "reward.remote_token_file");
  ro.tls.ca = cfg.reward.remote_tls_ca;
  ro.tls.server_name = cfg.reward.remote_tls_server_name;
  auto remote = std::make_shared<RemoteScorer>(ro);
  const std::string name = remote->check_health(Deadline::after_seconds(cfg.timeouts.startup_s));
  log::info("reward: the remote service at {} scores '{}'", ro.address, name);
  return {remote, ro.batch_size, ro.concurrency};
}

// reward.type python: a Python function in-process.
ScorerSetup make_python(const JobConfig& cfg) {
  PythonOptions po;
  po.spec = cfg.reward.python;
  po.batched = cfg.reward.python_batched;
  po.timeout_seconds = cfg.reward.python_timeout_s;
  auto python = std::make_shared<PythonScorer>(po);
  log::info("reward: {}{} in {} ({} worker thread(s), batches of {})", python->where(), po.batched ? " (batched)" : "",
            python->interpreter(), cfg.reward.python_workers, cfg.reward.python_batch_size);
  return {python, static_cast<int>(cfg.reward.python_batch_size), static_cast<int>(cfg.reward.python_workers)};
}

Registry<BatchScorerDef>& scorers() {
  static Registry<BatchScorerDef>* r = [] {
    auto* reg = new Registry<BatchScorerDef>(
        "batch scorer", [](const BatchScorerDef& d) { return d.make ? "" : "no factory (make)"; });
    reg->add("remote", {make_remote, "the reward service over gRPC (reward.remote_*)"});
    reg->add("python", {make_python, "a Python function in-process (reward.python_*)"});
    return reg;
  }();
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(batch_scorer, BatchScorerDef, scorers, "reward.scorer")

std::string job_batch_scorer(const JobConfig& job) {
  switch (job.reward.type) {
    case RewardType::kRemote: return "remote";
    case RewardType::kPython: return "python";
    case RewardType::kScorer: return job.reward.scorer;
    default: return "";
  }
}

ScorerSetup make_job_batch_scorer(const JobConfig& job) {
  const std::string name = job_batch_scorer(job);
  TILLER_CHECK(!name.empty(), "reward.type = {} is not scored by a batch scorer", enum_name(job.reward.type));
  ScorerSetup s = find_batch_scorer(name).make(job);
  if (!s.scorer)
    throw ConfigError(fmt::format("batch scorer '{}': its factory returned no scorer", name));
  if (s.batch_size < 1 || s.batch_size > 4096 || s.concurrency < 1 || s.concurrency > 4096)
    throw ConfigError(fmt::format("batch scorer '{}': batches of {} with concurrency {}; use 1 to 4096 samples and "
                                  "1 to 4096 batches at once",
                                  name, s.batch_size, s.concurrency));
  return s;
}

}  // namespace tiller::reward
