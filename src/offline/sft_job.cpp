// tiller sft: supervised fine-tuning on the ZeRO-3 trainer (tiller/offline/offline.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "controller/checkpoint_manager.h"
#include "offline/offline_run.h"
#include "offline/sft_data.h"
#include "tiller/algo/sft_loss.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/model/model_config.h"
#include "tiller/model/tokenizer.h"
#include "tiller/offline/offline.h"
#include "tiller/rollout/epoch_order.h"
#include "tiller/rollout/packer.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::offline {
namespace {

using Clock = std::chrono::steady_clock;

// One micro-batch's rows on this rank (its slice under sequence parallelism), as the loss takes them.
struct SftMicroBatch {
  zero::SequenceSlice slice;
  at::Tensor targets, mask, weight;  // [n] on the device
  int64_t tokens = 0;                 // every token of the micro-batch's samples (throughput)
};

SftMicroBatch sft_micro_batch(const std::vector<const SftSample*>& samples, const OfflineRun& run, bool sequence_mean) {
  SftMicroBatch mb;
  std::vector<int64_t> all;
  for (const SftSample* s : samples) {
    mb.slice.seq_lens.push_back(static_cast<int64_t>(s->tokens.size()));
    all.insert(all.end(), s->tokens.begin(), s->tokens.end());
  }
  mb.tokens = static_cast<int64_t>(all.size());
  const zero::SequenceSplit split{mb.tokens, run.sp};
  const int64_t first = split.begin(run.sp_rank), n = split.size(run.sp_rank);
  std::vector<int64_t> targets(static_cast<size_t>(n), 0);
  std::vector<float> mask(static_cast<size_t>(n), 0.f), weight(static_cast<size_t>(n), 0.f);
  int64_t off = 0;
  for (const SftSample* s : samples) {
    const int64_t len = static_cast<int64_t>(s->tokens.size());
    const float w = sequence_mean ? 1.f / static_cast<float>(s->trained()) : 1.f;
    for (int64_t r = std::max(off, first); r < std::min(off + len, first + n); ++r) {
      const int64_t t = r - off;
      if (t + 1 >= len) continue;  // a sequence's last token predicts nothing
      const size_t i = static_cast<size_t>(r - first);
      targets[i] = s->tokens[static_cast<size_t>(t + 1)];
      mask[i] = s->loss_mask[static_cast<size_t>(t + 1)] ? 1.f : 0.f;
      weight[i] = w;
    }
    off += len;
  }
  mb.slice.tokens = at::tensor(std::vector<int64_t>(all.begin() + first, all.begin() + first + n), at::kLong);
  mb.slice.first_row = first;
  mb.targets = at::tensor(targets, at::kLong).to(run.device);
  mb.mask = at::tensor(mask, at::kFloat).to(run.device);
  mb.weight = at::tensor(weight, at::kFloat).to(run.device);
  return mb;
}

struct Sums {
  double loss = 0, nll = 0, trained = 0, tokens = 0, samples = 0;
};

// The loss over the given samples (ids into `data`), in this rank's lockstep rounds; with `train`
// the gradients accumulate (backward per micro-batch). Collective. Sums over the whole group.
Sums run_rounds(OfflineRun& run, const SftDataset& data, const std::vector<int64_t>& ids, bool train,
                bool sequence_mean) {
  std::vector<int64_t> lens;
  double normalizer = 0;
  for (int64_t id : ids) {
    lens.push_back(static_cast<int64_t>(data.at(id).tokens.size()));
    normalizer += sequence_mean ? 1.0 : static_cast<double>(data.at(id).trained());
  }
  std::vector<int64_t> order(ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  const std::vector<rollout::Round> rounds = rollout::plan_rounds(order, lens, run.dp, run.budget(), run.attention_tokens);
  at::Tensor acc = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(run.device));  // loss, nll, trained
  double tokens = 0;
  std::optional<at::NoGradGuard> no_grad;
  if (!train) no_grad.emplace();
  for (const rollout::Round& round : rounds) {
    std::vector<const SftSample*> mine;
    for (int64_t i : round.at(static_cast<size_t>(run.dp_rank))) mine.push_back(&data.at(ids[static_cast<size_t>(i)]));
    const SftMicroBatch mb = sft_micro_batch(mine, run, sequence_mean);
    if (run.sp_rank == 0) tokens += static_cast<double>(mb.tokens);
    const at::Tensor lp = run.model->token_logprobs(mb.slice, mb.targets);
    if (mine.empty() || normalizer == 0) {
      if (train) (lp.sum() * 0).backward();  // lockstep: the group's collectives run on every rank
      continue;
    }
    const algo::SftLoss l = algo::sft_loss_weighted(lp, mb.mask, mb.weight, normalizer);
    if (train) l.loss.backward();
    acc += at::stack({l.loss.detach().to(at::kDouble), l.nll, l.tokens});
  }
  const at::Tensor totals = run.sum(at::cat({acc, at::tensor({tokens}, at::kDouble).to(run.device)}));
  Sums s;
  s.loss = totals[0].item<double>();
  s.nll = totals[1].item<double>();
  s.trained = totals[2].item<double>();
  s.tokens = totals[3].item<double>();
  s.samples = static_cast<double>(ids.size());
  return s;
}

}  // namespace

int run_sft(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options) {
  OfflineRun run(cfg, env, "sft");
  const bool sequence_mean = cfg.offline.loss_mean == OfflineLossMean::kSequence;

  // The data: every rank reads it (same file, same order).
  if (cfg.offline.data.empty()) throw ConfigError("offline.data: tiller sft needs a data file (JSONL or parquet)");
  const std::unique_ptr<model::Tokenizer> tok = model::load_tokenizer(cfg.roles.actor.model);
  const auto t_data = Clock::now();
  const SftDataset data(cfg.offline.data, *tok, sft_options(cfg, *tok, run.model_config, "offline.data"));
  std::optional<SftDataset> eval_file;
  if (!cfg.offline.eval_data.empty())
    eval_file.emplace(cfg.offline.eval_data, *tok, sft_options(cfg, *tok, run.model_config, "offline.eval_data"));
  const HeldOutSplit split = run.split(data.size(), eval_file ? eval_file->size() : -1, "samples");
  const std::vector<int64_t>& train_ids = split.train;
  const std::vector<int64_t>& eval_ids = split.eval;
  const SftDataset& eval_data = eval_file ? *eval_file : data;
  if (run.rank == 0)
    log::info("sft data: {} training and {} held-out samples ({} skipped over offline.max_tokens, {} truncated) in {:.1f} s",
              train_ids.size(), eval_ids.size(), data.skipped(), data.truncated(),
              std::chrono::duration<double>(Clock::now() - t_data).count());

  const int64_t n = static_cast<int64_t>(train_ids.size());
  rollout::EpochOrder order(n, cfg.data.shuffle, static_cast<uint64_t>(cfg.run.seed));
  const int64_t total = run.total_steps(n);

  const int64_t start = run.start(options, n, order);
  run.plan_schedule(total);

  auto evaluate = [&](int64_t step) {
    if (eval_ids.empty()) return;
    const auto t0 = Clock::now();
    const Sums e = run_rounds(run, eval_data, eval_ids, /*train=*/false, sequence_mean);
    const double nll = e.trained > 0 ? e.nll / e.trained : 0;
    run.log_metrics(step, {{"eval/loss", nll}, {"eval/trained_tokens", e.trained}, {"eval/samples", e.samples},
                           {"time/eval", std::chrono::duration<double>(Clock::now() - t0).count()}});
    if (run.rank == 0) log::info("step {}/{}: eval loss {:.4f} over {} samples", step, total, nll, eval_ids.size());
  };

  int64_t done = start;
  for (int64_t step = start; step < total && !run.stop_agreed(); ++step) {
    const auto t0 = Clock::now();
    const OfflineRun::Batch b = run.next_batch(order);
    std::vector<int64_t> ids;
    for (int64_t p : b.picks) ids.push_back(train_ids[static_cast<size_t>(p)]);
    const Sums s = run_rounds(run, data, ids, /*train=*/true, sequence_mean);
    const OfflineRun::StepOutcome st = run.optimizer_step(step);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double nll = s.trained > 0 ? s.nll / s.trained : 0;
    rollout::Metrics m{{"train/loss", s.loss},
                       {"train/nll_per_token", nll},
                       {"train/samples", s.samples},
                       {"train/trained_tokens", s.trained}};
    const rollout::Metrics common = run.step_metrics(st, b, s.tokens, seconds);
    m.insert(m.end(), common.begin(), common.end());
    run.log_metrics(step + 1, m);
    if (run.rank == 0)
      log::info("step {}/{}: loss {:.4f} ({:.4f} per token), lr {:.3g}, grad norm {:.3f}{}, {:.0f} tokens/s/GPU, epoch {}",
                step + 1, total, s.loss, nll, st.lr, st.grad_norm, st.skipped ? " (skipped: not finite)" : "",
                s.tokens / seconds / static_cast<double>(run.world), b.at_start.epoch + 1);
    const bool last = step + 1 == total;
    if (last || (cfg.offline.eval_every > 0 && (step + 1) % cfg.offline.eval_every == 0)) evaluate(step + 1);
    run.maybe_save(step + 1, order.cursor(), n, last);
    done = step + 1;
  }
  return run.finish(done, total, n, order.cursor());
}

}  // namespace tiller::offline
