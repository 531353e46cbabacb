// tiller dpo: direct preference optimisation against a frozen reference (tiller/offline/offline.h).
#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "model/host_upload.h"
#include "offline/offline_run.h"
#include "offline/preference_data.h"
#include "tiller/algo/preference.h"
#include "tiller/controller/packer.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/data/epoch_order.h"
#include "tiller/offline/offline.h"
#include "tiller/text/tokenizer.h"
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
  b.targets = model::upload(targets, device);
  b.mask = model::upload(mask, device);
  b.cu = at::tensor(cu, at::kLong);
  return b;
}


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
    for (const controller::Round& round : rounds(data, ids)) {
      const std::vector<int64_t>& mine = round.at(static_cast<size_t>(run_.dp_rank));
      const PairBatch b = pair_batch(data, ids, mine, run_.device);
      const at::Tensor lp = ref_->token_logprobs(b.slice, b.targets);
      if (mine.empty()) continue;
      const at::Tensor seq = algo::sequence_logps(lp, b.mask, b.cu, average_).to(at::kDouble).view({-1, 2});
      out.index_copy_(0, model::upload(mine, run_.device), seq);
    }
    return run_.sum(out);  // each pair was computed on one rank; the others hold zeros
  }

  // The DPO loss over pairs `ids`; `cached` [pairs, 2] the reference's log-probs in `ids` order, or
  // undefined to run the reference on the fly. With `train` the gradients accumulate. Collective.
  PreferenceSums run(const PreferenceDataset& data, const std::vector<int64_t>& ids, const at::Tensor& cached, bool train) {
    const double pairs = static_cast<double>(ids.size()), step_rows = pair_rows(data, ids);
    at::Tensor acc = at::zeros({5}, at::TensorOptions().dtype(at::kDouble).device(run_.device));
    double tokens = 0;
    std::optional<at::NoGradGuard> no_grad;
    if (!train) no_grad.emplace();
    for (const controller::Round& round : rounds(data, ids)) {
      const std::vector<int64_t>& mine = round.at(static_cast<size_t>(run_.dp_rank));
      const PairBatch b = pair_batch(data, ids, mine, run_.device);
      tokens += static_cast<double>(b.tokens);
      at::Tensor ref;
      if (!cached.defined()) {
        at::NoGradGuard ng;
        ref = ref_->token_logprobs(b.slice, b.targets);
      }
      const at::Tensor lp = run_.model->token_logprobs(b.slice, b.targets);
      // With a mixture of experts' router losses, when on (roles.actor.router_*_loss_coef).
      if (mine.empty()) {
        // Lockstep: the group's collectives run on every rank.
        if (train) run_.model->add_router_loss(lp.sum() * 0, step_rows).backward();
        continue;
      }
      const at::Tensor policy = algo::sequence_logps(lp, b.mask, b.cu, average_).view({-1, 2});
      const at::Tensor reference =
          cached.defined()
              ? model::upload(cached.index_select(0, at::tensor(mine, at::kLong)), run_.device, policy.scalar_type())
              : algo::sequence_logps(ref, b.mask, b.cu, average_).view({-1, 2});
      const algo::PreferenceLoss l = algo::dpo_loss(policy.select(1, 0), policy.select(1, 1), reference.select(1, 0),
                                                    reference.select(1, 1), opts_);
      const at::Tensor loss = l.losses.sum() / pairs;
      if (train) run_.model->add_router_loss(loss, step_rows).backward();
      acc += preference_row(loss, l);
    }
    return preference_totals(run_, acc, tokens, pairs);
  }

  // Frees the reference (its log-probs are cached).
  void drop_reference() { ref_.reset(); }

 private:
  std::vector<controller::Round> rounds(const PreferenceDataset& data, const std::vector<int64_t>& ids) const {
    std::vector<int64_t> order(ids.size()), lens;
    for (size_t i = 0; i < ids.size(); ++i) {
      order[i] = static_cast<int64_t>(i);
      const PreferencePair& p = data.at(ids[i]);
      lens.push_back(p.rows());
    }
    return controller::plan_rounds(order, lens, run_.dp, run_.budget(), run_.attention_tokens);
  }

  const JobConfig& cfg_;
  OfflineRun& run_;
  algo::DpoOptions opts_;
  bool average_ = false;
  std::unique_ptr<zero::ShardedModel> ref_;
};

}  // namespace

int run_dpo(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options) {
  if (cfg.roles.actor.sequence_parallel > 1)
    throw ConfigError("roles.actor.sequence_parallel: tiller dpo sums each response's log-probs on one rank and "
                      "needs whole sequences there; set it to 1");
  OfflineRun run(cfg, env, "dpo");
  const std::unique_ptr<text::Tokenizer> tok = text::load_tokenizer(cfg.roles.actor.model);
  const OfflineData<PreferenceDataset> d = load_offline_data<PreferenceDataset>(
      run, *tok, [&](const std::string& key) { return preference_options(cfg, *tok, run.model_config, key); }, "pairs");
  OfflineRun::Schedule plan = run.schedule(options, static_cast<int64_t>(d.split.train.size()));
  DpoTrainer dpo(cfg, run);
  // The reference's log-probs once per pair (then the reference is freed), or on the fly.
  at::Tensor ref_train, ref_eval;
  if (cfg.offline.dpo_reference == DpoReference::kPrecompute) {
    const auto t0 = Clock::now();
    ref_train = dpo.precompute(*d.data, d.split.train);
    if (!d.split.eval.empty()) ref_eval = dpo.precompute(d.eval(), d.split.eval);
    dpo.drop_reference();
    if (run.rank == 0)
      log::info("dpo: the reference's log-probs of {} pairs in {:.1f} s; the reference is freed",
                d.split.train.size() + d.split.eval.size(), std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // The cached rows of training pairs `ids` (indices into offline.data; ref_train is in split order).
  std::vector<int64_t> row_of(static_cast<size_t>(d.data->size()), -1);
  for (size_t i = 0; i < d.split.train.size(); ++i) row_of[static_cast<size_t>(d.split.train[i])] = static_cast<int64_t>(i);
  auto rows = [&](const at::Tensor& all, const std::vector<int64_t>& ids) {
    if (!all.defined()) return at::Tensor();
    std::vector<int64_t> r;
    for (int64_t id : ids) r.push_back(row_of[static_cast<size_t>(id)]);
    return all.index_select(0, at::tensor(r, at::kLong));
  };
  auto train = [&](const std::vector<int64_t>& ids) {
    return preference_pass(dpo.run(*d.data, ids, rows(ref_train, ids), /*train=*/true), "reward_accuracy",
                           "reward_margin");
  };
  std::function<OfflineRun::Pass()> eval;
  if (!d.split.eval.empty())
    eval = [&] {
      return preference_pass(dpo.run(d.eval(), d.split.eval, ref_eval, /*train=*/false), "reward_accuracy",
                             "reward_margin");
    };
  return run.train(d.split.train, plan.start, plan.total, plan.order, train, eval);
}

}  // namespace tiller::offline
