// tiller train-rm: a reward model from preference pairs (tiller/offline/offline.h).
#include <algorithm>
#include <chrono>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "offline/offline_run.h"
#include "offline/preference_data.h"
#include "tiller/algo/preference.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/model/tokenizer.h"
#include "tiller/offline/offline.h"
#include "tiller/rollout/epoch_order.h"
#include "tiller/rollout/packer.h"

namespace tiller::offline {
namespace {

using Clock = std::chrono::steady_clock;

struct PairSums {
  double loss = 0, chosen = 0, rejected = 0, correct = 0, margin = 0, tokens = 0, pairs = 0;
};

// The Bradley-Terry loss over pairs `ids` of `data`, each pair's two sequences side by side in one
// micro-batch (chosen, then rejected), scored at their last tokens. With `train` the gradients
// accumulate. Collective; sums over every rank.
PairSums run_pairs(OfflineRun& run, const PreferenceDataset& data, const std::vector<int64_t>& ids, bool train) {
  std::vector<int64_t> order(ids.size()), lens;
  for (size_t i = 0; i < ids.size(); ++i) {
    order[i] = static_cast<int64_t>(i);
    const PreferencePair& p = data.at(ids[i]);
    lens.push_back(static_cast<int64_t>(p.chosen.tokens.size() + p.rejected.tokens.size()));
  }
  const double pairs = static_cast<double>(ids.size());
  const std::vector<rollout::Round> rounds = rollout::plan_rounds(order, lens, run.dp, run.budget(), run.attention_tokens);
  // loss, chosen, rejected, correct, margin sums
  at::Tensor acc = at::zeros({5}, at::TensorOptions().dtype(at::kDouble).device(run.device));
  double tokens = 0;
  std::optional<at::NoGradGuard> no_grad;
  if (!train) no_grad.emplace();
  for (const rollout::Round& round : rounds) {
    const std::vector<int64_t>& mine = round.at(static_cast<size_t>(run.dp_rank));
    zero::SequenceSlice slice;
    std::vector<int64_t> all, last;
    std::vector<double> margins;
    for (int64_t i : mine) {
      const PreferencePair& p = data.at(ids[static_cast<size_t>(i)]);
      for (const SftSample* s : {&p.chosen, &p.rejected}) {
        slice.seq_lens.push_back(static_cast<int64_t>(s->tokens.size()));
        all.insert(all.end(), s->tokens.begin(), s->tokens.end());
        last.push_back(static_cast<int64_t>(all.size()) - 1);
      }
      margins.push_back(p.margin);
    }
    tokens += static_cast<double>(all.size());
    slice.tokens = at::tensor(all, at::kLong);
    const at::Tensor values = run.model->values(slice);
    if (mine.empty()) {
      if (train) (values.sum() * 0).backward();  // lockstep: the group's collectives run on every rank
      continue;
    }
    const at::Tensor scores = values.index_select(0, at::tensor(last, at::kLong).to(run.device)).view({-1, 2});
    const at::Tensor margin =
        data.has_margins() ? at::tensor(margins, at::kDouble).to(run.device, scores.scalar_type()) : at::Tensor();
    const algo::PreferenceLoss l = algo::bradley_terry_loss(scores.select(1, 0), scores.select(1, 1), margin);
    const at::Tensor loss = l.losses.sum() / pairs;
    if (train) loss.backward();
    acc += at::stack({loss.detach().to(at::kDouble), l.chosen_reward_sum, l.rejected_reward_sum, l.correct, l.margin_sum});
  }
  const at::Tensor t = run.sum(at::cat({acc, at::tensor({tokens}, at::kDouble).to(run.device)}));
  PairSums s;
  s.loss = t[0].item<double>();
  s.chosen = t[1].item<double>();
  s.rejected = t[2].item<double>();
  s.correct = t[3].item<double>();
  s.margin = t[4].item<double>();
  s.tokens = t[5].item<double>();
  s.pairs = pairs;
  return s;
}

rollout::Metrics pair_metrics(const std::string& prefix, const PairSums& s) {
  const double p = std::max(1.0, s.pairs);
  return {{prefix + "loss", s.loss},
          {prefix + "accuracy", s.correct / p},
          {prefix + "chosen_reward", s.chosen / p},
          {prefix + "rejected_reward", s.rejected / p},
          {prefix + "margin", s.margin / p},
          {prefix + "pairs", s.pairs}};
}

}  // namespace

int run_train_rm(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options) {
  if (cfg.roles.actor.sequence_parallel > 1)
    throw ConfigError("roles.actor.sequence_parallel: tiller train-rm scores each sequence at its last token and "
                      "needs whole sequences on a rank; set it to 1");
  OfflineRun run(cfg, env, "train-rm", model::Head::kValue);
  if (cfg.offline.data.empty()) throw ConfigError("offline.data: tiller train-rm needs a file of preference pairs (JSONL or parquet)");
  const std::unique_ptr<model::Tokenizer> tok = model::load_tokenizer(cfg.roles.actor.model);
  const PreferenceDataset data(cfg.offline.data, *tok, preference_options(cfg, *tok, run.model_config, "offline.data"));
  std::optional<PreferenceDataset> eval_file;
  if (!cfg.offline.eval_data.empty())
    eval_file.emplace(cfg.offline.eval_data, *tok, preference_options(cfg, *tok, run.model_config, "offline.eval_data"));
  const HeldOutSplit split = run.split(data.size(), eval_file ? eval_file->size() : -1, "pairs");
  const std::vector<int64_t>& train_ids = split.train;
  const std::vector<int64_t>& eval_ids = split.eval;
  const PreferenceDataset& eval_data = eval_file ? *eval_file : data;
  if (run.rank == 0)
    log::info("train-rm data: {} training and {} held-out pairs ({} skipped over offline.max_tokens, {} truncated){}",
              train_ids.size(), eval_ids.size(), data.skipped(), data.truncated(),
              data.has_margins() ? ", with margins" : "");

  const int64_t n = static_cast<int64_t>(train_ids.size());
  rollout::EpochOrder order(n, cfg.data.shuffle, static_cast<uint64_t>(cfg.run.seed));
  const int64_t total = run.total_steps(n);
  const int64_t start = run.start(options, n, order);
  run.plan_schedule(total);

  auto evaluate = [&](int64_t step) {
    if (eval_ids.empty()) return;
    const auto t0 = Clock::now();
    const PairSums e = run_pairs(run, eval_data, eval_ids, /*train=*/false);
    rollout::Metrics m = pair_metrics("eval/", e);
    m.emplace_back("time/eval", std::chrono::duration<double>(Clock::now() - t0).count());
    run.log_metrics(step, m);
    if (run.rank == 0)
      log::info("step {}/{}: eval loss {:.4f}, accuracy {:.3f}, margin {:.3f} over {} pairs", step, total,
                e.loss, e.correct / std::max(1.0, e.pairs),
                e.margin / std::max(1.0, e.pairs), eval_ids.size());
  };

  int64_t done = start;
  for (int64_t step = start; step < total && !run.stop_agreed(); ++step) {
    const auto t0 = Clock::now();
    const OfflineRun::Batch b = run.next_batch(order);
    std::vector<int64_t> ids;
    for (int64_t p : b.picks) ids.push_back(train_ids[static_cast<size_t>(p)]);
    const PairSums s = run_pairs(run, data, ids, /*train=*/true);
    const OfflineRun::StepOutcome st = run.optimizer_step(step);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    rollout::Metrics m = pair_metrics("train/", s);
    const rollout::Metrics common = run.step_metrics(st, b, s.tokens, seconds);
    m.insert(m.end(), common.begin(), common.end());
    run.log_metrics(step + 1, m);
    if (run.rank == 0)
      log::info("step {}/{}: loss {:.4f}, accuracy {:.3f}, margin {:.3f}, lr {:.3g}, grad norm {:.3f}{}, epoch {}",
                step + 1, total, s.loss, s.correct / s.pairs, s.margin / s.pairs, st.lr, st.grad_norm,
                st.skipped ? " (skipped: not finite)" : "", b.at_start.epoch + 1);
    const bool last = step + 1 == total;
    if (last || (cfg.offline.eval_every > 0 && (step + 1) % cfg.offline.eval_every == 0)) evaluate(step + 1);
    run.maybe_save(step + 1, order.cursor(), n, last);
    done = step + 1;
  }
  return run.finish(done, total, n, order.cursor());
}

}  // namespace tiller::offline
