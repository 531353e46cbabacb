// Models named by hub id, for the commands that run under mpirun (tiller train, sft, dpo, train-rm):
// found in the Hugging Face cache, or downloaded into it once per node (core/hub.h).

#include <fmt/format.h>

#include "commands.h"
#include "python/hub_download.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/hub.h"
#include "tiller/core/logging.h"
#include "tiller/dist/mpi_env.h"

namespace tiller::cli {
namespace {

// `m` into the cache unless it is there or HF_HUB_OFFLINE forbids it.
void download_if_missing(const HubModelRef& m, const std::string& where) {
  if (find_hub_snapshot(m.model) || hub_offline()) return;  // offline: the strict lookup says what to run
  log::info("{} = '{}@{}' is not in the Hugging Face cache ({}): downloading it{}", m.key, m.model.repo,
            m.model.revision, hub_cache_dir(), where);
  const std::string folder = python::download_hub_snapshot(m.key, m.model.repo, m.model.revision, hub_cache_dir());
  log::info("{}: downloaded to {}", m.key, folder);
}

}  // namespace

std::string fetch_hub_model(const std::string& spec, const std::string& key, dist::MpiEnv* env, double timeout_s) {
  const auto id = parse_hub_id(spec);
  if (!id) return spec;  // a folder (or nothing): as it is
  const HubModelRef m{key, *id};
  if (env != nullptr && env->size() > 1) {
    env->once_per_node([&] { download_if_missing(m, fmt::format(" on {} (rank {})", env->hostname(), env->rank())); },
                       "the download of " + key + " (" + std::to_string(static_cast<int64_t>(timeout_s)) + " s)",
                       timeout_s);
  } else {
    download_if_missing(m, "");
  }
  return resolve_hub_model(spec, key, /*strict=*/true);  // still missing: one line saying what to run
}

void fetch_hub_models(JobConfig& cfg, dist::MpiEnv& env) {
  const std::vector<HubModelRef> models = hub_models(cfg);
  if (models.empty()) return;  // the same config on every rank: none of them takes part
  // Each node's cache may differ (local disks), so every rank of a job with hub ids joins: on each
  // node its lowest rank downloads what that node's cache lacks, the others wait for every node.
  env.once_per_node(
      [&] {
        for (const HubModelRef& m : models)
          download_if_missing(m, fmt::format(" on {} (rank {})", env.hostname(), env.rank()));
      },
      "the download of the job's hub models (timeouts.download_s)", cfg.timeouts.download_s);
  resolve_hub_models(cfg, /*strict=*/true);  // a model still missing: one line saying what to run
}

}  // namespace tiller::cli
