// tiller dpo: direct preference optimisation against a frozen reference (tiller/offline/offline.h).
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
#include "tiller/zero/sharded_model.h"

namespace tiller::offline {
namespace {

using Clock = std::chrono::steady_clock;

// A micro-batch of pairs: each pair's chosen then rejected sequence, packed, with the rows whose
// targets are the responses' tokens.
struct PairBatch {
  zero::SequenceSlice slice;
  at::Tensor targets, mask;  // [T] on the device
  at::Tensor cu;             // [2k + 1] on the host
  int64_t tokens = 0;
};

PairBatch pair_batch(const PreferenceDataset& data, const std::vector<int64_t>& ids, const std::vector<int64_t>& mine,
                     at::Device device) {
  PairBatch b;
  std::vector<int64_t> all, targets, cu{0};
  std::vector<float> mask;
  for (int64_t i : mine) {
    const PreferencePair& p = data.at(ids[static_cast<size_t>(i)]);
    for (const SftSample* s : {&p.chosen, &p.rejected}) {
      const int64_t len = static_cast<int64_t>(s->tokens.size());
      b.slice.seq_lens.push_back(len);
      all.insert(all.end(), s->tokens.begin(), s->tokens.end());
      for (int64_t t = 0; t < len; ++t) {
        const bool has_next = t + 1 < len;
        targets.push_back(has_next ? s->tokens[static_cast<size_t>(t + 1)] : 0);
        mask.push_back(has_next && s->loss_mask[static_cast<size_t>(t + 1)] ? 1.f : 0.f);
      }
      cu.push_back(static_cast<int64_t>(all.size()));
    }
  }
  b.tokens = static_cast<int64_t>(all.size());
  b.slice.tokens = at::tensor(all, at::kLong);
  b.targets = at::tensor(targets, at::kLong).to(device);
  b.mask = at::tensor(mask, at::kFloat).to(device);
  b.cu = at::tensor(cu, at::kLong);
  return b;
}

struct DpoSums {
  double loss = 0, chosen = 0, rejected = 0, correct = 0, margin = 0, tokens = 0, pairs = 0;
};

class DpoTrainer {
 public:
  DpoTrainer(const JobConfig& cfg, OfflineRun& run) : cfg_(cfg), run_(run) {
    opts_.beta = cfg.offline.dpo_beta;
    opts_.label_smoothing = cfg.offline.dpo_label_smoothing;
    opts_.type = cfg.offline.dpo_loss == DpoLossKind::kIpo ? algo::DpoLossType::kIpo : algo::DpoLossType::kSigmoid;
    average_ = opts_.type == algo::DpoLossType::kIpo;
    const std::string dir = cfg.roles.ref.model.empty() ? cfg.roles.actor.model : cfg.roles.ref.model;
    ref_ = std::make_unique<zero::ShardedModel>(
        run.model_config, run.communicator(),
        zero::role_options("ref", cfg.roles.ref, cfg.train, /*trainable=*/false, model::Head::kLm, run.device));
    ref_->load_hf(dir);
    if (run.rank == 0) log::info("dpo: the reference is {} (frozen, ZeRO-3 over every rank)", dir);
  }

  // The reference's sequence log-probs of every pair of `data` (`ids`), computed once: [pairs, 2]
  // on the host, the same on every rank. Collective.
  at::Tensor precompute(const PreferenceDataset& data, const std::vector<int64_t>& ids) {
    at::Tensor out = at::zeros({static_cast<int64_t>(ids.size()), 2}, at::TensorOptions().dtype(at::kDouble).device(run_.device));
    at::NoGradGuard no_grad;
    for (const rollout::Round& round : rounds(data, ids)) {
      const std::vector<int64_t>& mine = round.at(static_cast<size_t>(run_.dp_rank));
      const PairBatch b = pair_batch(data, ids, mine, run_.device);
      const at::Tensor lp = ref_->token_logprobs(b.slice, b.targets);
      if (mine.empty()) continue;
      const at::Tensor seq = algo::sequence_logps(lp, b.mask, b.cu, average_).to(at::kDouble).view({-1, 2});
      out.index_copy_(0, at::tensor(mine, at::kLong).to(run_.device), seq);
    }
    return run_.sum(out);  // each pair was computed on one rank; the others hold zeros
  }

  // The DPO loss over pairs `ids`; `cached` [pairs, 2] the reference's log-probs in `ids` order, or
  // undefined to run the reference on the fly. With `train` the gradients accumulate. Collective.
  DpoSums run(const PreferenceDataset& data, const std::vector<int64_t>& ids, const at::Tensor& cached, bool train) {
    const double pairs = static_cast<double>(ids.size());
    at::Tensor acc = at::zeros({5}, at::TensorOptions().dtype(at::kDouble).device(run_.device));
    double tokens = 0;
    std::optional<at::NoGradGuard> no_grad;
    if (!train) no_grad.emplace();
    for (const rollout::Round& round : rounds(data, ids)) {
      const std::vector<int64_t>& mine = round.at(static_cast<size_t>(run_.dp_rank));
      const PairBatch b = pair_batch(data, ids, mine, run_.device);
      tokens += static_cast<double>(b.tokens);
      at::Tensor ref;
      if (!cached.defined()) {
        at::NoGradGuard ng;
        ref = ref_->token_logprobs(b.slice, b.targets);
      }
      const at::Tensor lp = run_.model->token_logprobs(b.slice, b.targets);
      if (mine.empty()) {
        if (train) (lp.sum() * 0).backward();  // lockstep: the group's collectives run on every rank
        continue;
      }
      const at::Tensor policy = algo::sequence_logps(lp, b.mask, b.cu, average_).view({-1, 2});
      const at::Tensor reference =
          cached.defined()
              ? cached.index_select(0, at::tensor(mine, at::kLong)).to(run_.device, policy.scalar_type())
              : algo::sequence_logps(ref, b.mask, b.cu, average_).view({-1, 2});
      const algo::PreferenceLoss l = algo::dpo_loss(policy.select(1, 0), policy.select(1, 1), reference.select(1, 0),
                                                    reference.select(1, 1), opts_);
      const at::Tensor loss = l.losses.sum() / pairs;
      if (train) loss.backward();
      acc += at::stack({loss.detach().to(at::kDouble), l.chosen_reward_sum, l.rejected_reward_sum, l.correct, l.margin_sum});
    }
    const at::Tensor t = run_.sum(at::cat({acc, at::tensor({tokens}, at::kDouble).to(run_.device)}));
    DpoSums s;
    s.loss = t[0].item<double>();
    s.chosen = t[1].item<double>();
    s.rejected = t[2].item<double>();
    s.correct = t[3].item<double>();
    s.margin = t[4].item<double>();
    s.tokens = t[5].item<double>();
    s.pairs = pairs;
    return s;
  }

  // Frees the reference (its log-probs are cached).
  void drop_reference() { ref_.reset(); }

 private:
  std::vector<rollout::Round> rounds(const PreferenceDataset& data, const std::vector<int64_t>& ids) const {
    std::vector<int64_t> order(ids.size()), lens;
    for (size_t i = 0; i < ids.size(); ++i) {
      order[i] = static_cast<int64_t>(i);
      const PreferencePair& p = data.at(ids[i]);
      lens.push_back(static_cast<int64_t>(p.chosen.tokens.size() + p.rejected.tokens.size()));
    }
    return rollout::plan_rounds(order, lens, run_.dp, run_.budget(), run_.attention_tokens);
  }

  const JobConfig& cfg_;
  OfflineRun& run_;
  algo::DpoOptions opts_;
  bool average_ = false;
  std::unique_ptr<zero::ShardedModel> ref_;
};

rollout::Metrics dpo_metrics(const std::string& prefix, const DpoSums& s) {
  const double p = std::max(1.0, s.pairs);
  return {{prefix + "loss", s.loss},
          {prefix + "reward_accuracy", s.correct / p},
          {prefix + "chosen_reward", s.chosen / p},
          {prefix + "rejected_reward", s.rejected / p},
          {prefix + "reward_margin", s.margin / p},
          {prefix + "pairs", s.pairs}};
}

}  // namespace

int run_dpo(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options) {
  if (cfg.roles.actor.sequence_parallel > 1)
    throw ConfigError("roles.actor.sequence_parallel: tiller dpo sums each response's log-probs on one rank and "
                      "needs whole sequences there; set it to 1");
  OfflineRun run(cfg, env, "dpo");
  if (cfg.offline.data.empty()) throw ConfigError("offline.data: tiller dpo needs a file of preference pairs (JSONL or parquet)");
  const std::unique_ptr<model::Tokenizer> tok = model::load_tokenizer(cfg.roles.actor.model);
  const PreferenceDataset data(cfg.offline.data, *tok, preference_options(cfg, *tok, run.model_config, "offline.data"));
  std::optional<PreferenceDataset> eval_file;
  if (!cfg.offline.eval_data.empty())
    eval_file.emplace(cfg.offline.eval_data, *tok, preference_options(cfg, *tok, run.model_config, "offline.eval_data"));
  const HeldOutSplit split = run.split(data.size(), eval_file ? eval_file->size() : -1, "pairs");
  const std::vector<int64_t>& train_ids = split.train;
  const std::vector<int64_t>& eval_ids = split.eval;
  const PreferenceDataset& eval_data = eval_file ? *eval_file : data;
  const int64_t n = static_cast<int64_t>(train_ids.size());
  rollout::EpochOrder order(n, cfg.data.shuffle, static_cast<uint64_t>(cfg.run.seed));
  const int64_t total = run.total_steps(n);
  const int64_t start = run.start(options, n, order);
  run.plan_schedule(total);

  DpoTrainer dpo(cfg, run);
  // The reference's log-probs once per pair (then the reference is freed), or on the fly.
  at::Tensor ref_train, ref_eval;
  const bool cached = cfg.offline.dpo_reference == DpoReference::kPrecompute;
  if (cached) {
    const auto t0 = Clock::now();
    ref_train = dpo.precompute(data, train_ids);
    if (!eval_ids.empty()) ref_eval = dpo.precompute(eval_data, eval_ids);
    dpo.drop_reference();
    if (run.rank == 0)
      log::info("dpo: the reference's log-probs of {} pairs in {:.1f} s; the reference is freed", train_ids.size() + eval_ids.size(),
                std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (run.rank == 0)
    log::info("dpo data: {} training and {} held-out pairs ({} skipped over offline.max_tokens, {} truncated)",
              train_ids.size(), eval_ids.size(), data.skipped(), data.truncated());
  // The cached rows of the pairs at positions `picks` of the training split.
  auto rows = [](const at::Tensor& all, const std::vector<int64_t>& picks) {
    return all.defined() ? all.index_select(0, at::tensor(picks, at::kLong)) : at::Tensor();
  };

  auto evaluate = [&](int64_t step) {
    if (eval_ids.empty()) return;
    const auto t0 = Clock::now();
    const DpoSums e = dpo.run(eval_data, eval_ids, ref_eval, /*train=*/false);
    rollout::Metrics m = dpo_metrics("eval/", e);
    m.emplace_back("time/eval", std::chrono::duration<double>(Clock::now() - t0).count());
    run.log_metrics(step, m);
    if (run.rank == 0)
      log::info("step {}/{}: eval loss {:.4f}, reward accuracy {:.3f}, margin {:.3f} over {} pairs", step, total, e.loss,
                e.correct / std::max(1.0, e.pairs), e.margin / std::max(1.0, e.pairs), eval_ids.size());
  };

  int64_t done = start;
  for (int64_t step = start; step < total && !run.stop_agreed(); ++step) {
    const auto t0 = Clock::now();
    const OfflineRun::Batch b = run.next_batch(order);
    std::vector<int64_t> ids;
    for (int64_t p : b.picks) ids.push_back(train_ids[static_cast<size_t>(p)]);
    const DpoSums s = dpo.run(data, ids, rows(ref_train, b.picks), /*train=*/true);
    const OfflineRun::StepOutcome st = run.optimizer_step(step);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    rollout::Metrics m = dpo_metrics("train/", s);
    const rollout::Metrics common = run.step_metrics(st, b, s.tokens, seconds);
    m.insert(m.end(), common.begin(), common.end());
    run.log_metrics(step + 1, m);
    if (run.rank == 0)
      log::info("step {}/{}: loss {:.4f}, reward accuracy {:.3f}, margin {:.4f}, lr {:.3g}, grad norm {:.3f}{}, epoch {}",
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
