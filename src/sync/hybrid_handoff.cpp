// The hybrid engine's weight sync (hybrid_handoff.h).
#include "tiller/sync/hybrid_handoff.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "sync/bucket_packer.h"
#include "sync/sync_protocol.h"
#include "sync/slice_placer.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/engine/engine.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::sync {
namespace {

// The hybrid votes (the disaggregated ones are protocol::Vote).
enum HybridVote : int64_t { kParked = 0, kNotParked = 1, kWrongPlan = 2, kWeightsAsleep = 3 };

// A LoRA actor's frozen base as a full plan (the engine's weights are the actor's compute dtype):
// what a handoff sends, before the adapters, to an engine that dropped its weights (sleep level 2).
// Both sides derive it from the adapter-only plan, so they agree without a second install.
BucketPlan lora_base_plan(const model::ModelConfig& cfg, const BucketPlan& adapters, at::ScalarType dtype) {
  return make_bucket_plan(cfg, adapters.senders, adapters.tp_size, protocol::wire_dtype_name(dtype),
                          adapters.bucket_bytes);
}

const char* hybrid_vote_reason(int64_t v) {
  switch (v) {
    case kNotParked: return "its engine did not begin this update in time (BeginWeightUpdate names the version)";
    case kWrongPlan: return "its engine holds another bucket plan (install this plan first)";
    case kWeightsAsleep: return "its engine's weights are asleep (level 2): wake them before the sync";
    default: return "unknown reason";
  }
}

void synchronize(const at::Device& d) {
  if (d.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->synchronizeDevice(d.index());
}

}  // namespace

struct LocalWeightSink::Impl {
  engine::Engine& engine;
  double timeout_s;
  std::optional<BucketPlan> plan;
  SlicePlacer placer;
  // An adapter-only plan's: the base's plan and placer, and the engine's weight_drops() when the
  // base was last whole (its load counts as whole: it is the actor's base).
  std::optional<BucketPlan> base_plan;
  SlicePlacer base_placer;
  uint64_t base_whole_at = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool parked = false;    // the engine's thread waits in receive()
  bool claimed = false;   // the handoff has begun writing under this park: receive() waits it out
  uint64_t parked_version = 0;
  std::optional<Result> outcome;

  Impl(engine::Engine& e, double t) : engine(e), timeout_s(t) {}

  // The handoff's end: wakes the parked engine with `r`.
  void finish(Result r) {
    {
      std::lock_guard<std::mutex> lock(mu);
      outcome = std::move(r);
    }
    cv.notify_all();
  }
};

LocalWeightSink::LocalWeightSink(engine::Engine& engine, double timeout_s)
    : impl_(std::make_unique<Impl>(engine, timeout_s)) {}

LocalWeightSink::~LocalWeightSink() = default;

uint64_t LocalWeightSink::install_plan(const std::string& text) {
  Impl& m = *impl_;
  BucketPlan p = BucketPlan::from_json(text, "weight sync plan");
  SlicePlacer placer(p, m.engine);
  std::optional<BucketPlan> base;
  SlicePlacer base_placer;
  if (p.adapters_only()) {
    base = lora_base_plan(m.engine.config(), p, m.engine.parameters().at("model.embed_tokens.weight").scalar_type());
    base_placer = SlicePlacer(*base, m.engine, /*lora_base=*/true);
  }
  std::lock_guard<std::mutex> lock(m.mu);
  TILLER_CHECK(!m.parked, "a sync plan installed during a handoff");
  m.placer = std::move(placer);
  m.plan = std::move(p);
  m.base_plan = std::move(base);
  m.base_placer = std::move(base_placer);
  log::info("weight sync plan {:016x} (hybrid, on the device): {} buckets, {:.1f} MiB", m.plan->id,
            m.plan->buckets.size(), static_cast<double>(m.plan->wire_bytes()) / (1 << 20));
  return m.plan->id;
}

uint64_t LocalWeightSink::plan_id() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->plan ? impl_->plan->id : 0;
}

engine::WeightSink::Result LocalWeightSink::receive(uint64_t version) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  m.parked = true;
  m.claimed = false;
  m.parked_version = version;
  m.outcome.reset();
  m.cv.notify_all();
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                             std::chrono::duration<double>(m.timeout_s));
  // Unclaimed, the park ends at the deadline; claimed, the handoff always finishes (its own
  // collectives have deadlines) and the weights must not be used before it has.
  while (!m.outcome) {
    if (m.claimed) {
      m.cv.wait(lock);
    } else if (m.cv.wait_until(lock, until) == std::cv_status::timeout && !m.claimed && !m.outcome) {
      m.parked = false;
      Result r;
      r.error = fmt::format("weight sync to version {}: the actor did not hand the weights over within {:.0f} s "
                            "(timeouts.weight_sync_s); the weights are unchanged",
                            version, m.timeout_s);
      return r;
    }
  }
  m.parked = false;
  return *m.outcome;
}

struct HybridHandoff::Impl {
  zero::ShardedModel& actor;
  dist::Communicator& comm;
  BucketPlan plan;
  LocalWeightSink::Impl& sink;
  double timeout_s;
  BucketPacker packer;
  // A LoRA actor's frozen base (lora_base_plan), for an engine that dropped its weights. Its packer
  // (two staging buffers of a bucket) is made at the first such sync: an engine that keeps its
  // base (sleep level 0 or 1) never needs it.
  std::unique_ptr<BucketPlan> base_plan;
  std::unique_ptr<BucketPacker> base_packer;

  Impl(zero::ShardedModel& a, dist::Communicator& c, BucketPlan p, LocalWeightSink& s, double t)
      : actor(a), comm(c), plan(std::move(p)), sink(*s.impl_), timeout_s(t), packer(plan, actor, "hybrid weight sync") {
    if (actor.lora())
      base_plan = std::make_unique<BucketPlan>(lora_base_plan(actor.config(), plan, actor.options().compute_dtype));
  }

  // Waits until the engine is parked on `version` and claims the park; false at the deadline.
  bool claim(uint64_t version, const Deadline& deadline) {
    std::unique_lock<std::mutex> lock(sink.mu);
    while (!(sink.parked && sink.parked_version == version && !sink.outcome)) {
      if (deadline.expired()) return false;
      sink.cv.wait_for(lock, std::chrono::milliseconds(10));
    }
    sink.claimed = true;
    return true;
  }

  int64_t vote(bool parked) {
    if (!parked) return kNotParked;
    std::lock_guard<std::mutex> lock(sink.mu);
    if (!sink.plan || sink.plan->id != plan.id) return kWrongPlan;
    if (base_plan && (!sink.base_plan || sink.base_plan->id != base_plan->id)) return kWrongPlan;
    if (sink.engine.sleep_level() >= 2) return kWeightsAsleep;
    return kParked;
  }

  // Whether this rank's engine lost its base since it was last whole (a LoRA actor's plan only).
  bool base_lost() {
    std::lock_guard<std::mutex> lock(sink.mu);
    return base_plan && sink.engine.weight_drops() != sink.base_whole_at;
  }

  // Broadcasts `p`'s buckets over the actor group, each packed by its sender, and places this
  // rank's slices of each into the engine's weights (two buffers: bucket k + 1 travels while k is
  // placed). Sets r.weights_changed once a bucket is placed.
  void run(const BucketPlan& p, const BucketPacker& pk, const SlicePlacer& placer, int me, const Deadline& deadline,
           engine::WeightSink::Result& r) {
    std::vector<dist::WorkPtr> works(p.buckets.size());
    auto issue = [&](size_t k) {
      // The buffer's previous bucket (k - 2) was placed on this stream before this packing runs.
      pk.pack(k, me);
      works[k] = comm.broadcast(pk.buffer(k), p.buckets[k].sender);
    };
    if (!p.buckets.empty()) issue(0);
    for (size_t k = 0; k < p.buckets.size(); ++k) {
      if (k + 1 < p.buckets.size()) issue(k + 1);
      works[k]->wait_on_stream();
      r.weights_changed = true;
      r.base_changed = r.base_changed || !p.adapters_only();
      placer.place(k, pk.buffer(k));
    }
    for (auto& w : works) w->wait(deadline);
  }
};

HybridHandoff::HybridHandoff(zero::ShardedModel& actor, dist::Communicator& comm, BucketPlan plan,
                             LocalWeightSink& sink, double timeout_s)
    : impl_(std::make_unique<Impl>(actor, comm, std::move(plan), sink, timeout_s)) {
  Impl& m = *impl_;
  if (m.plan.senders != actor.world() || comm.size() != actor.world() || comm.rank() != actor.rank())
    throw ConfigError(fmt::format("hybrid weight sync: the plan is for {} actor ranks and the actor group has {}; "
                                  "actor rank {} must be rank {} of the sync communicator of {} ranks (the actor's)",
                                  m.plan.senders, actor.world(), actor.rank(), comm.rank(), comm.size()));
}

HybridHandoff::~HybridHandoff() = default;

SyncStats HybridHandoff::send(uint64_t version) {
  Impl& m = *impl_;
  const auto [t0, deadline, control, me] = protocol::begin_send(m.comm, m.timeout_s, m.packer.device());
  const std::string what = fmt::format("hybrid weight sync to version {} (actor rank {})", version, me);

  const bool parked = m.claim(version, deadline);
  // The collectives get the whole timeout again: a rank that waited out its park still votes.
  const Deadline vote_deadline = Deadline::after_seconds(m.timeout_s);
  engine::WeightSink::Result r;
  // Whatever happens from here, a claimed engine is released with the outcome.
  struct Release {
    Impl& m;
    bool claimed;
    engine::WeightSink::Result& r;
    ~Release() {
      if (!claimed) return;
      if (!r.complete && r.error.empty()) r.error = "the hybrid weight sync ended early (see the actor rank's log)";
      m.sink.finish(r);
    }
  } release{m, parked, r};

  // Each rank's vote, then (a LoRA actor) whether its engine lost the base: then every rank sends
  // the base before the adapters.
  const int64_t n = m.comm.size();
  at::Tensor ballot = at::zeros({2 * n}, control);
  ballot[me].fill_(m.vote(parked));
  if (parked && m.base_lost()) ballot[n + me].fill_(1);
  m.comm.all_reduce(ballot)->wait(vote_deadline);
  ballot = ballot.cpu();
  const at::Tensor votes = ballot.narrow(0, 0, n);
  const bool send_base = ballot.narrow(0, n, n).count_nonzero().item<int64_t>() > 0;
  if (votes.count_nonzero().item<int64_t>() != 0) {
    std::string why;
    for (int64_t i = 0; i < votes.numel(); ++i)
      if (const int64_t v = votes[i].item<int64_t>(); v != 0)
        why += fmt::format("{}actor rank {}: {}", why.empty() ? "" : "; ", i, hybrid_vote_reason(v));
    r.error = fmt::format("{} refused: {}; no weight changed", what, why);
    throw SyncRefused(r.error);
  }

  uint64_t drops = 0;
  try {
    c10::InferenceMode inference;  // the engine's weights are inference tensors
    if (send_base) {
      drops = m.sink.engine.weight_drops();  // the engine is parked: it cannot sleep meanwhile
      if (!m.base_packer)
        m.base_packer = std::make_unique<BucketPacker>(*m.base_plan, m.actor, "hybrid weight sync (the LoRA base)", true);
      m.run(*m.base_plan, *m.base_packer, m.sink.base_placer, me, vote_deadline, r);
    }
    m.run(m.plan, m.packer, m.sink.placer, me, vote_deadline, r);
    synchronize(m.packer.device());  // the copies into the engine's weights are complete
  } catch (const std::exception& e) {
    r.error = fmt::format("{} failed {}: {}", what,
                          r.weights_changed ? "part way, the engine's weights are incomplete" : "before any weight changed",
                          e.what());
  }
  at::Tensor done = at::full({1}, r.error.empty() ? 1 : 0, control);
  try {
    m.comm.all_reduce(done, dist::ReduceOp::kMin)->wait(vote_deadline);
  } catch (const std::exception& e) {
    if (r.error.empty()) r.error = fmt::format("{}: the closing handshake failed: {}", what, e.what());
  }
  if (r.error.empty() && done.cpu().item<int64_t>() != 1)
    r.error = fmt::format("{}: another actor rank failed to place its engine's weights (see its log)", what);
  r.complete = r.error.empty();
  if (!r.complete) throw CommError(r.error);
  if (send_base) {
    std::lock_guard<std::mutex> lock(m.sink.mu);
    m.sink.base_whole_at = drops;
  }
  SyncStats st;
  st.version = version;
  st.buckets = static_cast<int64_t>(m.plan.buckets.size() + (send_base ? m.base_plan->buckets.size() : 0));
  st.wire_bytes = m.plan.wire_bytes() + (send_base ? m.base_plan->wire_bytes() : 0);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace tiller::sync
