// What the offline trainers share (private to src/offline): the ranks' devices and communicators,
// the trained model (roles.actor, ZeRO-3 over every rank, sequence groups of
// roles.actor.sequence_parallel), the learning-rate schedule and the optimizer step, metrics
// (JSONL, TensorBoard, rank 0), checkpoints under checkpoint.dir with the data cursor (the
// controller's step_NNNNNN layout, so `tiller launch` resumes them), SIGINT/SIGTERM as a clean
// stop, and the HF export at the end.
//
// Memory: the trained model's plan (offline_memory_plan in tiller/offline/offline.h, which `tiller
// plan --command` prints) resolves
// train.recompute and train.compute_shard `auto`, every rank taking the least-memory choice of any,
// and on GPUs a plan that cannot fit is refused before anything is allocated.
//
// Collective contract: every rank constructs it and calls start, optimizer_step, sum,
// stop_agreed, maybe_save and finish in the same order.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <ATen/core/Tensor.h>

#include "offline/preference_data.h"
#include "offline/sft_data.h"
#include "tiller/controller/metrics.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/core/signals.h"
#include "tiller/data/epoch_order.h"
#include "tiller/dist/communicator.h"
#include "tiller/job/memory_plan.h"
#include "tiller/model/model_config.h"
#include "tiller/zero/optimizer.h"
#include "tiller/zero/sharded_model.h"
#include "zero/run_checkpoints.h"

namespace tiller::text {
class Tokenizer;
}  // namespace tiller::text
namespace tiller::algo {
struct PreferenceLoss;
}
namespace tiller::dist {
class MpiEnv;
}

namespace tiller::offline {

struct OfflineOptions;

class OfflineRun {
 public:
  // Devices, communicators and the (empty) model with `head` (the LM head, or a reward model's
  // value head); `name` is the command ("sft"). ConfigError when the job's ranks are not
  // roles.actor.gpus, or the device or backend cannot be had.
  OfflineRun(const JobConfig& cfg, dist::MpiEnv& env, const std::string& name, model::Head head = model::Head::kLm);
  ~OfflineRun();
  OfflineRun(const OfflineRun&) = delete;
  OfflineRun& operator=(const OfflineRun&) = delete;

  // Loads the newest checkpoint under checkpoint.dir (checkpoint.resume, or --resume, which fails
  // without one) and moves `order` to its cursor, or else the HF model roles.actor.model (a value
  // head it lacks starts as OpenRLHF's does: normal, std 1 / (hidden + 1), seeded by run.seed). Returns
  // the optimizer steps already done. ConfigError when the checkpoint was made on data of another
  // size (`dataset_size` training samples now).
  int64_t start(const OfflineOptions& options, int64_t dataset_size, data::EpochOrder& order);
  // The run's steps over `samples` training samples: offline.epochs of ceil(samples /
  // train.train_batch_size), or offline.max_steps if fewer.
  int64_t total_steps(int64_t samples) const;
  // The schedule over `samples` training samples: their epoch order (run.seed, data.shuffle), the
  // steps, and the steps already done (start(): a resumed run's, the order at its cursor); the
  // learning-rate schedule planned over the steps.
  struct Schedule {
    data::EpochOrder order;
    int64_t total = 0, start = 0;
  };
  Schedule schedule(const OfflineOptions& options, int64_t samples);
  // The run's optimizer steps, for the learning-rate schedule (train.lr_schedule over them).
  void plan_schedule(int64_t total_steps);

  struct StepOutcome {
    double lr = 0, grad_norm = 0, clip_factor = 1;
    bool skipped = false;  // a non-finite gradient norm: no update
  };
  // Clipping and AdamW at step `step` (from 0) of the schedule.
  StepOutcome optimizer_step(int64_t step);
  // `t` (fp64, on the run's device) summed over every rank; returned on the host.
  at::Tensor sum(const at::Tensor& t);
  // Rank 0: appends the metrics of `step` to the JSONL file and TensorBoard.
  void log_metrics(int64_t step, const controller::Metrics& metrics);
  // True on every rank once any rank was asked to stop (SIGINT/SIGTERM).
  bool stop_agreed();
  // Saves a checkpoint of `step` when checkpoint.every_steps says so, or `force` (checkpoint.dir set).
  void maybe_save(int64_t step, const data::DatasetCursor& cursor, int64_t dataset_size, bool force);
  // After the loop: a run that did all `total` steps is exported as an HF checkpoint
  // (offline.export_dir); a stopped one saves where it stands. Returns the exit code.
  int finish(int64_t steps_done, int64_t total, int64_t dataset_size, const data::DatasetCursor& cursor);

  int64_t budget() const;  // tokens of one micro-batch (per sequence group)
  dist::Communicator& communicator() const { return *comm_; }  // the model's

  // The training and held-out samples: with an offline.eval_data file of `eval_file_size` records
  // (>= 0), every record of offline.data trains; else offline.eval_samples of its `data_size` are
  // held out (drawn with run.seed). ConfigError when nothing would be left to train on.
  HeldOutSplit split(int64_t data_size, int64_t eval_file_size, const char* what) const;

  // One step's samples: positions in the training split's epoch order (an epoch's last step may
  // take fewer), the cursor where the step started, and the epochs done after it.
  struct Batch {
    std::vector<int64_t> picks;
    data::DatasetCursor at_start;
    double epochs_done = 0;
  };
  Batch next_batch(data::EpochOrder& order);
  // What a pass over samples reports: its metrics (unprefixed: "loss", ...), its tokens (every
  // rank's), and its part of the progress line ("loss 0.41, accuracy 0.90").
  struct Pass {
    controller::Metrics metrics;
    double tokens = 0;
    std::string summary;
  };
  // Steps start .. total - 1 over the training split `train_ids` in `order`: each step's sample
  // ids go to `train_pass` (collective: the loss over them, backpropagated), then the optimizer
  // step, the metrics (train/..., the optimizer's, epoch, time, throughput), the progress line, the
  // held-out `eval_pass` (eval/...; every offline.eval_every steps and after the last; none when
  // null), and the checkpoints. Stops early, on every rank, when a rank is asked to (SIGTERM).
  // Returns finish()'s exit code.
  int train(const std::vector<int64_t>& train_ids, int64_t start, int64_t total, data::EpochOrder& order,
            const std::function<Pass(const std::vector<int64_t>& ids)>& train_pass,
            const std::function<Pass()>& eval_pass);

  const JobConfig& cfg;
  const std::string name;
  const model::Head head;
  int rank = 0, world = 1;
  int sp = 1, sp_rank = 0;   // the sequence group: S ranks, this rank's place in it
  int dp = 1, dp_rank = 0;   // data-parallel groups (world / S) and this rank's
  at::Device device = at::kCPU;
  model::ModelConfig model_config;
  double attention_tokens = 0;

 private:
  std::unique_ptr<dist::Communicator> world_comm_, device_comm_, sequence_group_;
  dist::Communicator* comm_ = nullptr;  // the model's: NCCL on GPUs, else the world
 public:
  std::unique_ptr<zero::ShardedModel> model;

 private:
  void save(int64_t step, const data::DatasetCursor& cursor, int64_t dataset_size);
  void export_model(const std::string& checkpoint);

  zero::LrSchedule schedule_;
  zero::RunCheckpoints checkpoints_;
  int64_t saved_step_ = -1;
  std::unique_ptr<controller::JsonlWriter> jsonl_;
  std::unique_ptr<controller::TensorBoardWriter> tensorboard_;
  std::atomic<bool> stop_requested_{false};
  bool stopped_ = false;
  std::unique_ptr<StopSignalWatcher> watcher_;
};

// What a pass over preference pairs sums over every rank (train-rm's scores, dpo's implicit rewards).
struct PreferenceSums {
  double loss = 0, chosen = 0, rejected = 0, correct = 0, margin = 0, tokens = 0, pairs = 0;
};
// A micro-batch's row of the sums (on the device, no wait): its loss and the loss's statistics.
at::Tensor preference_row(const at::Tensor& loss, const algo::PreferenceLoss& l);
// The sums of the rows `acc` ([5]: loss, chosen, rejected, correct, margin) over every rank, with
// the pass's `tokens` (this rank's) and `pairs`.
PreferenceSums preference_totals(OfflineRun& run, const at::Tensor& acc, double tokens, double pairs);
// Its metrics: loss, `accuracy` (pairs whose chosen reward is higher), chosen_reward,
// rejected_reward, `margin` (the mean chosen - rejected), pairs; under the given names.
OfflineRun::Pass preference_pass(const PreferenceSums& s, const char* accuracy, const char* margin);

// A job's data: offline.data, and offline.eval_data when set; the training and held-out split.
template <typename Dataset>
struct OfflineData {
  std::unique_ptr<Dataset> data, eval_file;
  HeldOutSplit split;
  const Dataset& eval() const { return eval_file ? *eval_file : *data; }
};
// Reads them (every rank; `options(path_key)` gives the dataset's options) and logs the split on
// rank 0; `what` names the records ("samples", "pairs"). ConfigError without offline.data.
template <typename Dataset, typename MakeOptions>
OfflineData<Dataset> load_offline_data(const OfflineRun& run, const text::Tokenizer& tok, MakeOptions options,
                                       const char* what) {
  const JobConfig& cfg = run.cfg;
  if (cfg.offline.data.empty())
    throw ConfigError(fmt::format("offline.data: tiller {} needs a data file (JSONL or parquet)", run.name));
  OfflineData<Dataset> d;
  d.data = std::make_unique<Dataset>(cfg.offline.data, tok, options("offline.data"));
  if (!cfg.offline.eval_data.empty())
    d.eval_file = std::make_unique<Dataset>(cfg.offline.eval_data, tok, options("offline.eval_data"));
  d.split = run.split(d.data->size(), d.eval_file ? d.eval_file->size() : -1, what);
  if (run.rank == 0)
    log::info("{} data: {} training and {} held-out {} ({} skipped over offline.max_tokens, {} truncated)", run.name,
              d.split.train.size(), d.split.eval.size(), what, d.data->skipped(), d.data->truncated());
  return d;
}

// The data options of offline.* and data.* (the chat format from the tokenizer when
// data.apply_chat_template; its EOS ends plain-text responses); `path_key` names the file's key.
SftDataOptions sft_options(const JobConfig& cfg, const text::Tokenizer& tok, const model::ModelConfig& mc,
                           const std::string& path_key);
PreferenceDataOptions preference_options(const JobConfig& cfg, const text::Tokenizer& tok,
                                         const model::ModelConfig& mc, const std::string& path_key);

}  // namespace tiller::offline
