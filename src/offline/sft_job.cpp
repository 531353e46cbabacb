// tiller sft: supervised fine-tuning on the ZeRO-3 trainer (tiller/offline/offline.h).
#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "model/host_upload.h"
#include "offline/offline_run.h"
#include "offline/sft_data.h"
#include "tiller/algo/sft_loss.h"
#include "tiller/controller/packer.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/data/epoch_order.h"
#include "tiller/model/model_config.h"
#include "tiller/offline/offline.h"
#include "tiller/text/tokenizer.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::offline {
namespace {

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
  mb.targets = model::upload(targets, run.device);
  mb.mask = model::upload(mask, run.device);
  mb.weight = model::upload(weight, run.device);
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
  const double step_rows = static_cast<double>(std::max<int64_t>(1, std::accumulate(lens.begin(), lens.end(), int64_t{0})));
  std::vector<int64_t> order(ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  const std::vector<controller::Round> rounds = controller::plan_rounds(order, lens, run.dp, run.budget(), run.attention_tokens);
  at::Tensor acc = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(run.device));  // loss, nll, trained
  double tokens = 0;
  std::optional<at::NoGradGuard> no_grad;
  if (!train) no_grad.emplace();
  for (const controller::Round& round : rounds) {
    std::vector<const SftSample*> mine;
    for (int64_t i : round.at(static_cast<size_t>(run.dp_rank))) mine.push_back(&data.at(ids[static_cast<size_t>(i)]));
    const SftMicroBatch mb = sft_micro_batch(mine, run, sequence_mean);
    if (run.sp_rank == 0) tokens += static_cast<double>(mb.tokens);
    const at::Tensor lp = run.model->token_logprobs(mb.slice, mb.targets);
    // With a mixture of experts' router losses, when on (roles.actor.router_*_loss_coef).
    if (mine.empty() || normalizer == 0) {
      // Lockstep: the group's collectives run on every rank.
      if (train) run.model->add_router_loss(lp.sum() * 0, step_rows).backward();
      continue;
    }
    const algo::SftLoss l = algo::sft_loss_weighted(lp, mb.mask, mb.weight, normalizer);
    if (train) run.model->add_router_loss(l.loss, step_rows).backward();
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

OfflineRun::Pass sft_pass(const Sums& s) {
  const double nll = s.trained > 0 ? s.nll / s.trained : 0;
  OfflineRun::Pass p;
  p.metrics = {{"loss", s.loss}, {"nll_per_token", nll}, {"samples", s.samples}, {"trained_tokens", s.trained}};
  p.tokens = s.tokens;
  p.summary = fmt::format("loss {:.4f} ({:.4f} per token)", s.loss, nll);
  return p;
}

}  // namespace

int run_sft(const JobConfig& cfg, dist::MpiEnv& env, const OfflineOptions& options) {
  OfflineRun run(cfg, env, "sft");
  const bool sequence_mean = cfg.offline.loss_mean == OfflineLossMean::kSequence;
  // The data: every rank reads it (same file, same order).
  const std::unique_ptr<text::Tokenizer> tok = text::load_tokenizer(cfg.roles.actor.model);
  const OfflineData<SftDataset> d = load_offline_data<SftDataset>(
      run, *tok, [&](const std::string& key) { return sft_options(cfg, *tok, run.model_config, key); }, "samples");
  OfflineRun::Schedule plan = run.schedule(options, static_cast<int64_t>(d.split.train.size()));
  auto train = [&](const std::vector<int64_t>& ids) {
    return sft_pass(run_rounds(run, *d.data, ids, /*train=*/true, sequence_mean));
  };
  std::function<OfflineRun::Pass()> eval;
  if (!d.split.eval.empty())
    eval = [&] {
      // Held out: the token mean of the negative log-likelihood, whatever the training objective.
      const Sums e = run_rounds(run, d.eval(), d.split.eval, /*train=*/false, /*sequence_mean=*/false);
      OfflineRun::Pass p = sft_pass(e);
      p.metrics = {{"loss", e.trained > 0 ? e.nll / e.trained : 0}, {"trained_tokens", e.trained}, {"samples", e.samples}};
      p.summary = fmt::format("loss {:.4f} over {} samples", e.trained > 0 ? e.nll / e.trained : 0, d.split.eval.size());
      return p;
    };
  return run.train(d.split.train, plan.start, plan.total, plan.order, train, eval);
}

}  // namespace tiller::offline
