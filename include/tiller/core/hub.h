// Models named by their Hugging Face hub id ("Qwen/Qwen2.5-7B-Instruct", or with a revision:
// "Qwen/Qwen2.5-7B-Instruct@main", "...@<commit>"), found in the Hugging Face cache as
// huggingface_hub lays it out: $HF_HUB_CACHE, else $HF_HOME/hub, else
// $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; in it
// models--<org>--<name>/refs/<revision> holds a commit and snapshots/<commit>/ the files.
//
// tiller train and the offline commands download a model that is not in the cache through
// huggingface_hub (python/hub_download.h), once per node, the node's other ranks waiting
// (timeouts.download_s), unless HF_HUB_OFFLINE is set: then a model not in the cache is an error
// that says what to run (`huggingface-cli download ...`, on every node, or into a shared
// HF_HUB_CACHE).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace tiller {

struct JobConfig;

struct HubModel {
  std::string repo;      // "Qwen/Qwen2.5-7B-Instruct"
  std::string revision;  // "main" unless given
};

// `spec` as a hub id: org/name[@revision] of [A-Za-z0-9._-], not a path that exists here and not
// one that starts with '/', '.' or '~'. nullopt otherwise.
std::optional<HubModel> parse_hub_id(const std::string& spec);

// The cache folder of hub models (above).
std::string hub_cache_dir();

// The snapshot folder of `model` in the cache, or nullopt when it is not there (no such repo,
// revision or snapshot, or the snapshot has no config.json).
std::optional<std::string> find_hub_snapshot(const HubModel& model);

// huggingface_hub's offline switch: HF_HUB_OFFLINE set to 1, true, yes or on (any case).
bool hub_offline();

// A model the job loads, given as a hub id: the config key that names it and the id.
struct HubModelRef {
  std::string key;  // "roles.actor.model"
  HubModel model;
};
// Every model of `cfg` given as a hub id (roles.*.model of the enabled roles, engines.model),
// found in the cache or not.
std::vector<HubModelRef> hub_models(const JobConfig& cfg);

// `spec` as its snapshot folder when it is a hub id in the cache; a folder (or any non-id) as it
// is. A hub id not in the cache: `strict`, a ConfigError naming `key` ("--model",
// "roles.actor.model") and the command that downloads it; otherwise `spec` as it is.
std::string resolve_hub_model(const std::string& spec, const std::string& key, bool strict);

// Replaces every model given as a hub id (roles.*.model, engines.model) with its snapshot folder.
// `strict`: a hub id not in the cache is a ConfigError naming the key and the command that
// downloads it; otherwise it is left as it is (tiller plan and config read configs on machines
// without the models).
void resolve_hub_models(JobConfig& cfg, bool strict);

}  // namespace tiller
