// The offline trainers: jobs with no engines and no controller, every rank one ZeRO-3 group
// training roles.actor on a dataset (docs/offline.md).
//
//   tiller sft       supervised fine-tuning: the negative log-likelihood of the trained tokens
//                    (assistant turns, or responses), token or sequence mean
//   tiller train-rm  a reward model (a value head scoring each sequence at its last token) with the
//                    Bradley-Terry loss on chosen/rejected pairs, optional per-pair margins
//   tiller dpo       DPO (sigmoid, cDPO, IPO) against a frozen reference (roles.ref.model, else the
//                    starting model), its log-probs precomputed once per pair or on the fly
//
// Launched like tiller train: `mpirun -np roles.actor.gpus tiller sft -c cfg.yaml`. Each rank reads
// the data itself (the same file, the same order), so the ranks agree on every step's samples
// without communicating; a step's samples are packed into micro-batches of at most
// train.micro_batch_tokens and dealt to the ranks in lockstep rounds (controller/packer.h), empty
// micro-batches where a round has fewer than the ranks. Under roles.actor.sequence_parallel S,
// each group of S consecutive ranks shares a micro-batch.
#pragma once

#include <cstdint>
#include <string>

#include "tiller/job/memory_plan.h"

namespace tiller {
struct JobConfig;
}
namespace tiller::dist {
class MpiEnv;
}

namespace tiller::offline {

struct OfflineOptions {
  bool require_resume = false;  // --resume: fail when checkpoint.dir holds no checkpoint
};

// Every rank runs it. Returns the exit code (0: done, or stopped by SIGINT/SIGTERM after saving).
// Throws ConfigError / IoError naming the key, file:line or rank; a failing rank ends the job.
int run_sft(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options = {});
// The reward model and DPO: the same contract; sequence parallelism is refused (each pair's scores
// or log-probs are taken on one rank).
int run_train_rm(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options = {});
int run_dpo(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options = {});

// The trained model's memory plan (job/memory_plan.h: plan_trainer over roles.actor.gpus ranks
// at train.micro_batch_tokens per rank) on GPUs of `gpu_bytes` (0: no choice by size), as the job
// plans it at start-up; `tiller plan --command` prints it. A reward model is planned with the LM
// head (a slight overestimate); DPO's reference on the fly is not counted. With `check`,
// ConfigError naming what to change when it cannot fit.
job::MemoryPlan offline_memory_plan(const JobConfig& cfg, const model::ModelConfig& shape, int64_t gpu_bytes,
                                        const std::string& command, bool check);

}  // namespace tiller::offline
