#include "rollout/role_worker.h"

#include <sys/resource.h>

#include <array>
#include <chrono>
#include <map>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "rollout/protocol.h"
#include "tiller/algo/algo.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/groups.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/model/model_config.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/transformer.h"
#include "tiller/sync/bucket_plan.h"
#include "tiller/sync/weight_sync.h"
#include "tiller/zero/checkpoint.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::rollout {

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
double wall_us() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

// The model directory a role loads: its own, else the actor's (ref, critic).
std::string role_model_dir(const JobConfig& cfg, const std::string& role) {
  const RoleConfig& r = role == "actor" ? cfg.roles.actor
                        : role == "critic" ? cfg.roles.critic
                        : role == "ref"    ? cfg.roles.ref
                                           : cfg.roles.reward;
  if (!r.model.empty()) return r.model;
  if (role == "reward") throw ConfigError("roles.reward.model: the reward role needs a model directory");
  if (cfg.roles.actor.model.empty()) throw ConfigError("roles.actor.model: the actor needs a model directory");
  return cfg.roles.actor.model;
}

const RoleConfig& role_config(const JobConfig& cfg, const std::string& role) {
  if (role == "actor") return cfg.roles.actor;
  if (role == "critic") return cfg.roles.critic;
  if (role == "ref") return cfg.roles.ref;
  return cfg.roles.reward;
}

// One micro-batch as the model takes it.
struct MicroBatch {
  model::PackedBatch batch;
  at::Tensor targets;    // [T]: the next token of each position (0 at a sequence's end)
  at::Tensor resp_rows;  // [R]: the rows whose next token is a response token
  at::Tensor last_rows;  // [B]: each sequence's last row
  int64_t samples = 0;
};

MicroBatch micro_batch(const Message& m, at::Device dev) {
  const at::Tensor tokens = m.tensors.at(0), seq_lens = m.tensors.at(1), prompt_lens = m.tensors.at(2);
  const int64_t b = seq_lens.numel();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* pl = prompt_lens.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> seqs;
  std::vector<int64_t> targets, rows, last;
  int64_t off = 0;
  for (int64_t i = 0; i < b; ++i) {
    TILLER_CHECK(pl[i] >= 1 && pl[i] < sl[i], "sample {} of a micro-batch: prompt {} of sequence {}", i, pl[i], sl[i]);
    seqs.emplace_back(tp + off, tp + off + sl[i]);
    for (int64_t t = 0; t < sl[i]; ++t) targets.push_back(t + 1 < sl[i] ? tp[off + t + 1] : 0);
    for (int64_t t = pl[i] - 1; t < sl[i] - 1; ++t) rows.push_back(off + t);
    last.push_back(off + sl[i] - 1);
    off += sl[i];
  }
  TILLER_CHECK(off == tokens.numel(), "a micro-batch's lengths add up to {}, its tokens are {}", off, tokens.numel());
  MicroBatch mb;
  mb.samples = b;
  mb.batch = model::PackedBatch::pack(seqs, dev);
  mb.targets = at::tensor(targets, at::kLong).to(dev);
  mb.resp_rows = at::tensor(rows, at::kLong).to(dev);
  mb.last_rows = at::tensor(last, at::kLong).to(dev);
  return mb;
}

at::Tensor host_float(const at::Tensor& t) { return t.detach().to(at::kCPU, at::kFloat).contiguous(); }

}  // namespace

struct RoleWorker::Impl {
  const JobConfig& cfg;
  const dist::RankPlan& plan;
  int rank;
  dist::GroupCommunicators& groups;
  dist::Communicator& world;
  at::Device device;
  std::vector<std::string> roles;  // this rank's, in the order actor, ref, critic, reward
  std::map<std::string, std::unique_ptr<zero::ShardedModel>> models;
  std::unique_ptr<sync::WeightSender> sender;
  double temperature = 1.0;
  // Statistics of the micro-batches since the last step, per trained role.
  std::map<std::string, std::array<double, kStepStatCount>> acc;
  std::vector<std::string> span_names;
  std::vector<double> span_times;

  Impl(const JobConfig& c, const dist::RankPlan& p, int r, dist::GroupCommunicators& g, dist::Communicator& w,
       const std::string& dev)
      : cfg(c), plan(p), rank(r), groups(g), world(w), device(dev) {
    temperature = cfg.rollout.temperature > 0 ? cfg.rollout.temperature : 1.0;
    const auto& mine = plan.ranks.at(static_cast<size_t>(rank)).roles;
    for (const char* name : {"actor", "ref", "critic", "reward"})
      if (std::find(mine.begin(), mine.end(), name) != mine.end()) roles.emplace_back(name);
    for (const auto& role : roles) load(role);
    if (models.count("actor") && groups.weight_sync) {
      const auto& actor = *models.at("actor");
      const std::string wire = cfg.roles.actor.dtype == "bf16" ? "bf16" : "fp32";
      sync::BucketPlan bp = sync::make_bucket_plan(actor.config(), actor.world(), static_cast<int>(cfg.engines.tp),
                                                   wire, cfg.engines.sync_bucket_mb << 20);
      sender = std::make_unique<sync::WeightSender>(*models.at("actor"), *groups.weight_sync, std::move(bp),
                                                    cfg.timeouts.weight_sync_s);
    }
  }

  void load(const std::string& role) {
    const std::string dir = role_model_dir(cfg, role);
    const model::ModelConfig mc = model::load_model_config(dir);
    const bool trainable = role == "actor" || role == "critic";
    const model::Head head = role == "actor" || role == "ref" ? model::Head::kLm : model::Head::kValue;
    dist::Communicator* comm = groups.role(role);
    TILLER_CHECK(comm != nullptr, "rank {} has role {} but no communicator for it", rank, role);
    comm->set_timeout(cfg.timeouts.collective_s);
    auto opts = zero::role_options(role, role_config(cfg, role), cfg.train, trainable, head, device);
    auto m = std::make_unique<zero::ShardedModel>(mc, *comm, opts);
    model::CheckpointReader reader(dir);
    model::NamedTensors named = reader.all();
    if (head == model::Head::kValue && !named.count("score.weight")) {
      if (role == "reward")
        throw ConfigError(fmt::format("roles.reward.model = {}: no 'score.weight'; a reward model needs a value head "
                                      "(a sequence-classification checkpoint with one label)",
                                      dir));
      // A critic started from a language model: a fresh value head that predicts 0 everywhere.
      named["score.weight"] = at::zeros({1, mc.hidden_size}, at::kFloat);
      if (comm->rank() == 0) log::info("critic: {} has no value head; starting one at zero", dir);
    }
    m->load(named, dir);
    models[role] = std::move(m);
  }

  void span(const std::string& name, double begin_us) {
    if (span_names.size() > 100000) return;  // nobody asks for traces: stop recording
    span_names.push_back(name);
    span_times.push_back(begin_us);
    span_times.push_back(wall_us());
  }

  Message score(const Message& in) {
    c10::AutoGradMode no_grad(false);
    const MicroBatch mb = micro_batch(in, device);
    Message out;
    for (const auto& role : roles) {
      const auto t0 = Clock::now();
      const double w0 = wall_us();
      zero::ShardedModel& m = *models.at(role);
      if (role == "actor" || role == "ref") {
        at::Tensor entropy;
        at::Tensor lp = m.token_logprobs(mb.batch, mb.targets, temperature, role == "actor" ? &entropy : nullptr);
        out.tensors.push_back(host_float(lp.index_select(0, mb.resp_rows)));
        if (role == "actor") out.tensors.push_back(host_float(entropy.index_select(0, mb.resp_rows)));
      } else if (role == "critic") {
        out.tensors.push_back(host_float(m.values(mb.batch).index_select(0, mb.resp_rows)));
      } else {
        out.tensors.push_back(host_float(m.values(mb.batch).index_select(0, mb.last_rows)));
      }
      out.scalars.push_back(seconds_since(t0));
      span("score." + role, w0);
    }
    return out;
  }

  void train_actor(const Message& in) {
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    zero::ShardedModel& m = *models.at("actor");
    const MicroBatch mb = micro_batch(in, device);
    at::Tensor entropy;
    at::Tensor lp = m.token_logprobs(mb.batch, mb.targets, temperature, &entropy);
    auto& a = acc["actor"];
    if (mb.samples == 0) {
      (lp.sum() * 0).backward();  // lockstep: the group's collectives run on every rank
    } else {
      const double normalizer = in.scalars.at(0), kl_coef = in.scalars.at(1);
      auto on = [&](const at::Tensor& t) { return t.to(device); };
      at::Tensor logp = lp.index_select(0, mb.resp_rows);
      const at::Tensor old = on(in.tensors.at(3)), adv = on(in.tensors.at(4));
      at::Tensor is_w;
      if (in.tensors.at(6).numel() > 0)
        is_w = algo::truncated_is_weights(old, on(in.tensors.at(6)), cfg.algo.tis_cap);
      algo::PolicyLossConfig pc{cfg.algo.clip_eps_low, cfg.algo.clip_eps_high, cfg.algo.dual_clip};
      algo::PolicyLoss pl = algo::policy_loss(logp, old, adv, pc, normalizer, is_w);
      at::Tensor loss = pl.loss;
      if (kl_coef > 0 && in.tensors.at(5).numel() > 0)
        loss = loss + algo::kl_loss(logp, on(in.tensors.at(5)), algo::parse_kl_estimator(cfg.algo.kl_estimator),
                                    kl_coef, normalizer);
      const at::Tensor resp_entropy = entropy.index_select(0, mb.resp_rows);
      if (cfg.algo.entropy_coef > 0)
        loss = loss + algo::entropy_bonus(resp_entropy, cfg.algo.entropy_coef, normalizer);
      loss.backward();
      const double n = static_cast<double>(logp.numel());
      a[kLoss] += loss.item<double>();
      a[kClipTokens] += pl.clip_fraction * n;
      a[kApproxKlTokens] += pl.approx_kl * n;
      a[kEntropySum] += resp_entropy.detach().sum().item<double>();
      a[kTokens] += n;
    }
    a[kTrainSeconds] += seconds_since(t0);
    span("train.actor", w0);
  }

  void train_critic(const Message& in) {
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    zero::ShardedModel& m = *models.at("critic");
    const MicroBatch mb = micro_batch(in, device);
    at::Tensor v = m.values(mb.batch);
    auto& a = acc["critic"];
    if (mb.samples == 0) {
      (v.sum() * 0).backward();
    } else {
      const double normalizer = in.scalars.at(0);
      at::Tensor vals = v.index_select(0, mb.resp_rows);
      algo::ValueLoss vl = algo::value_loss(vals, in.tensors.at(3).to(device), in.tensors.at(4).to(device),
                                            cfg.algo.value_clip, normalizer);
      vl.loss.backward();
      const double n = static_cast<double>(vals.numel());
      a[kLoss] += vl.loss.item<double>();
      a[kClipTokens] += vl.clip_fraction * n;
      a[kTokens] += n;
    }
    a[kTrainSeconds] += seconds_since(t0);
    span("train.critic", w0);
  }

  Message step(const std::string& role, double lr) {
    const auto t0 = Clock::now();
    const double w0 = wall_us();
    const zero::StepResult r = models.at(role)->step(lr);
    auto a = acc[role];
    acc.erase(role);
    a[kGradNorm] = r.grad_norm;
    a[kSkipped] = r.skipped ? 1 : 0;
    a[kStepSeconds] = seconds_since(t0);
    a[kPeakMb] = peak_rss_mb();
    span("step." + role, w0);
    Message out;
    out.scalars.assign(a.begin(), a.end());
    return out;
  }

  Message sync_weights(uint64_t version) {
    TILLER_CHECK(sender != nullptr, "rank {}: a weight sync, but this rank sends none", rank);
    const double w0 = wall_us();
    const sync::SyncStats s = sender->send(version);
    span("sync", w0);
    Message out;
    out.scalars = {s.seconds, static_cast<double>(s.wire_bytes)};
    return out;
  }

  Message save(const std::string& dir) {
    const double w0 = wall_us();
    for (const auto& role : roles) {
      if (role != "actor" && role != "critic") continue;  // frozen roles do not change
      zero::SaveOptions so;
      so.source_model = role_model_dir(cfg, role);
      zero::save_checkpoint(*models.at(role), dir + "/" + role, so);
    }
    span("checkpoint", w0);
    return {};
  }

  Message load_state(const std::string& dir) {
    for (const auto& role : roles)
      if (role == "actor" || role == "critic") zero::load_checkpoint(*models.at(role), dir + "/" + role);
    return {};
  }

  Message trace() {
    Message out;
    for (const auto& n : span_names) out.text += n + "\n";
    out.tensors.push_back(at::tensor(span_times, at::kDouble));
    span_names.clear();
    span_times.clear();
    return out;
  }
};

RoleWorker::RoleWorker(const JobConfig& cfg, const dist::RankPlan& plan, int rank, dist::GroupCommunicators& groups,
                       dist::Communicator& world, const std::string& device)
    : impl_(std::make_unique<Impl>(cfg, plan, rank, groups, world, device)) {}

RoleWorker::~RoleWorker() = default;

void RoleWorker::serve() {
  Impl& m = *impl_;
  const int controller = m.plan.controller;
  // The longest the controller may stay silent towards this rank: a whole generation, the other
  // group's training, a sync and a collective's worth.
  const double idle_s = m.cfg.timeouts.generate_s + m.cfg.timeouts.train_s + m.cfg.timeouts.weight_sync_s +
                        m.cfg.timeouts.collective_s;
  std::vector<dist::WorkPtr> sending;
  auto reply = [&](Message msg) {
    msg.op = Op::kReply;
    for (auto& w : sending) w->wait();
    sending = send_message(m.world, controller, msg);
  };
  for (;;) {
    IncomingMessage next(m.world, controller);
    const Deadline deadline = Deadline::after_seconds(idle_s);
    auto backoff = std::chrono::microseconds(50);
    while (!next.poll()) {
      if (deadline.expired())
        throw TimeoutError(fmt::format("rank {}: no message from the controller (rank {}) in {:.0f} s "
                                       "(timeouts.generate_s + train_s + weight_sync_s + collective_s); is it alive?",
                                       m.rank, controller, idle_s));
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::microseconds(2000));
    }
    const Message in = next.take();
    try {
      switch (in.op) {
        case Op::kScore: reply(m.score(in)); break;
        case Op::kTrainActor: m.train_actor(in); break;
        case Op::kTrainCritic: m.train_critic(in); break;
        case Op::kStepActor: reply(m.step("actor", in.scalars.at(0))); break;
        case Op::kStepCritic: reply(m.step("critic", in.scalars.at(0))); break;
        case Op::kSync: reply(m.sync_weights(static_cast<uint64_t>(in.scalars.at(0)))); break;
        case Op::kSave: reply(m.save(in.text)); break;
        case Op::kLoad: reply(m.load_state(in.text)); break;
        case Op::kTrace: reply(m.trace()); break;
        case Op::kStop: {
          Message out;
          out.scalars = {peak_rss_mb()};
          reply(out);
          for (auto& w : sending) w->wait();
          return;
        }
        default:
          throw CommError(fmt::format("rank {}: unexpected message '{}' from the controller", m.rank,
                                      op_name(in.op)));
      }
    } catch (const std::exception& e) {
      Message err;
      err.text = std::string("error: ") + e.what();
      try {
        reply(err);
        for (auto& w : sending) w->wait(Deadline::after_seconds(10));
      } catch (...) {
      }
      throw;
    }
  }
}

}  // namespace tiller::rollout
