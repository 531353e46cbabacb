// tiller train-rm: a reward model from preference pairs (tiller/offline/offline.h).
#include <algorithm>
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

namespace tiller::offline {
namespace {


// The Bradley-Terry loss over pairs `ids` of `data`, each pair's two sequences side by side in one
// micro-batch (chosen, then rejected), scored at their last tokens. With `train` the gradients
// accumulate. Collective; sums over every rank.
PreferenceSums run_pairs(OfflineRun& run, const PreferenceDataset& data, const std::vector<int64_t>& ids, bool train) {
  std::vector<int64_t> order(ids.size()), lens;
  for (size_t i = 0; i < ids.size(); ++i) {
    order[i] = static_cast<int64_t>(i);
    const PreferencePair& p = data.at(ids[i]);
    lens.push_back(p.rows());
  }
  const double pairs = static_cast<double>(ids.size()), step_rows = pair_rows(data, ids);
  const std::vector<controller::Round> rounds = controller::plan_rounds(order, lens, run.dp, run.budget(), run.attention_tokens);
  // loss, chosen, rejected, correct, margin sums
  at::Tensor acc = at::zeros({5}, at::TensorOptions().dtype(at::kDouble).device(run.device));
  double tokens = 0;
  std::optional<at::NoGradGuard> no_grad;
  if (!train) no_grad.emplace();
  for (const controller::Round& round : rounds) {
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
    // With a mixture of experts' router losses, when on (roles.actor.router_*_loss_coef).
    if (mine.empty()) {
      // Lockstep: the group's collectives run on every rank.
      if (train) run.model->add_router_loss(values.sum() * 0, step_rows).backward();
      continue;
    }
    const at::Tensor scores = values.index_select(0, model::upload(last, run.device)).view({-1, 2});
    const at::Tensor margin =
        data.has_margins() ? at::tensor(margins, at::kDouble).to(run.device, scores.scalar_type()) : at::Tensor();
    const algo::PreferenceLoss l = algo::bradley_terry_loss(scores.select(1, 0), scores.select(1, 1), margin);
    const at::Tensor loss = l.losses.sum() / pairs;
    if (train) run.model->add_router_loss(loss, step_rows).backward();
    acc += preference_row(loss, l);
  }
  return preference_totals(run, acc, tokens, pairs);
}

}  // namespace

int run_train_rm(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options) {
  if (cfg.roles.actor.sequence_parallel > 1)
    throw ConfigError("roles.actor.sequence_parallel: tiller train-rm scores each sequence at its last token and "
                      "needs whole sequences on a rank; set it to 1");
  OfflineRun run(cfg, env, "train-rm", model::Head::kValue);
  const std::unique_ptr<text::Tokenizer> tok = text::load_tokenizer(cfg.roles.actor.model);
  const OfflineData<PreferenceDataset> d = load_offline_data<PreferenceDataset>(
      run, *tok, [&](const std::string& key) { return preference_options(cfg, *tok, run.model_config, key); }, "pairs");
  OfflineRun::Schedule plan = run.schedule(options, static_cast<int64_t>(d.split.train.size()));
  auto train = [&](const std::vector<int64_t>& ids) {
    return preference_pass(run_pairs(run, *d.data, ids, /*train=*/true), "accuracy", "margin");
  };
  std::function<OfflineRun::Pass()> eval;
  if (!d.split.eval.empty())
    eval = [&] { return preference_pass(run_pairs(run, d.eval(), d.split.eval, /*train=*/false), "accuracy", "margin"); };
  return run.train(d.split.train, plan.start, plan.total, plan.order, train, eval);
}

}  // namespace tiller::offline
