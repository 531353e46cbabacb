// Sharded checkpoints of a ShardedModel, and their consolidation into a Hugging Face directory.
//
// A checkpoint directory holds one model:
//   meta.json               format, world size, optimizer steps, head, dtypes, unit shard sizes,
//                           the HF directory the model came from (for tokenizer files at export)
//   config.json             the model, as transformers reads it
//   rank_00000.safetensors  one per rank: "<unit>.master" (fp32 masters; the compute shard of a
//   ...                     frozen model), "<unit>.exp_avg", "<unit>.exp_avg_sq", and the
//                           generator states "rng.cpu" / "rng.cuda" (uint8)
//
// Saving is atomic: the ranks write into DIR.tmp and fsync; they agree (one all-reduce) that
// every rank succeeded; then rank 0 writes meta.json, moves an existing DIR aside to DIR.old,
// renames DIR.tmp to DIR and removes DIR.old. A crash or a failure on any rank at any point
// leaves the previous checkpoint complete (in DIR, or in DIR.old, which loading falls back to),
// and a failure is raised on every rank.
//
// Collective contract: every rank of the model's group calls save/load together. The directory
// must be on a file system every rank of the group sees (as DeepSpeed's checkpoints).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

namespace tiller::zero {

class ShardedModel;

struct SaveOptions {
  std::string source_model;  // the HF directory the model was loaded from ("" if none)
  // Fault injection for tests: called on every rank after its shard is written, before the ranks
  // agree; a throw counts as that rank's failure.
  std::function<void(int rank)> after_write;
};

// Collective. Throws IoError (on every rank) if any rank fails; the previous DIR is untouched.
void save_checkpoint(ShardedModel& model, const std::string& dir, const SaveOptions& options = {});

// Collective. Restores shards, optimizer moments and steps, and the generator states. Throws
// ConfigError when the checkpoint does not fit the model (world size, shapes, head), IoError
// when a file is missing or corrupt; on every rank, naming the rank that failed.
void load_checkpoint(ShardedModel& model, const std::string& dir);

// Seeds the process's default generators (the CPU's, and `device`'s when it is a GPU), whose
// states the checkpoints save, from a run's seed and the process's rank. ATen seeds the CPU's from
// the system's entropy: without this two runs of one job would write different checkpoint files,
// and an op that draws from them would not repeat. Call once at start-up, before any resume.
void seed_default_generators(uint64_t seed, int rank, const at::Device& device);

// Optimizer steps recorded in a checkpoint (reads meta.json only).
int64_t checkpoint_steps(const std::string& dir);

// Consolidates a checkpoint into `out_dir` (config.json + safetensors, sharded above 5 GB) that
// transformers loads, in `dtype`; copies the tokenizer and generation files of the source model
// (`base_dir` when given) when that directory still exists. Reads every rank's file; one process,
// no communication. A LoRA checkpoint (adapters only) is merged into its base, the source model or
// `base_dir` (ConfigError when neither is a directory): W + scale * B A in fp32, rounded to `dtype`
// (PEFT's merge), and a critic's trained value head beside it.
void export_hf(const std::string& checkpoint_dir, const std::string& out_dir, at::ScalarType dtype,
               const std::string& base_dir = "");
// A LoRA checkpoint's adapters as PEFT's files in `out_dir` (adapter_config.json +
// adapter_model.safetensors, fp32, base_model_name_or_path the source model or `base_dir`), which
// PeftModel.from_pretrained loads onto the base. ConfigError for a checkpoint without adapters, or
// a critic's (its value head is not an adapter: export it merged).
void export_lora_adapter(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& base_dir = "");

}  // namespace tiller::zero
