// The engine side of a weight sync (weight_sync.h).
#include <array>
#include <chrono>
#include <optional>

#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include "sync/sync_protocol.h"
#include "sync/slice_placer.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/engine/engine.h"
#include "tiller/sync/weight_sync.h"

namespace tiller::sync {

struct WeightReceiver::Impl {
  engine::Engine& engine;
  dist::Communicator& comm;
  double timeout_s;
  at::Device device = at::kCPU;
  std::optional<BucketPlan> plan;
  SlicePlacer placer;
  std::array<at::Tensor, 2> staging;
  SyncStats last;

  Impl(engine::Engine& e, dist::Communicator& c, double t) : engine(e), comm(c), timeout_s(t) {}
};

WeightReceiver::WeightReceiver(engine::Engine& engine, dist::Communicator& comm, double timeout_s)
    : impl_(std::make_unique<Impl>(engine, comm, timeout_s)) {
  impl_->device = at::Device(engine.options().device);
}

WeightReceiver::~WeightReceiver() = default;

uint64_t WeightReceiver::plan_id() const { return impl_->plan ? impl_->plan->id : 0; }
const SyncStats& WeightReceiver::last() const { return impl_->last; }

uint64_t WeightReceiver::install_plan(const std::string& text) {
  Impl& m = *impl_;
  BucketPlan p = BucketPlan::from_json(text, "weight sync plan");
  if (m.comm.rank() < p.senders || m.comm.size() <= p.senders)
    throw ConfigError(fmt::format("weight sync plan {:016x} does not fit engine TP rank {}: this rank is rank {} of {} "
                                  "in the sync communicator, whose first {} ranks must be the actor's",
                                  p.id, m.engine.tp_rank(), m.comm.rank(), m.comm.size(), p.senders));
  SlicePlacer placer(p, m.engine);
  const at::ScalarType wire = protocol::wire_scalar_type(p.wire_dtype);
  const auto opts = at::TensorOptions().dtype(wire).device(m.device);
  for (auto& s : m.staging) s = at::empty({p.largest_bucket_numel()}, opts);
  m.placer = std::move(placer);
  m.plan = std::move(p);
  log::info("weight sync plan {:016x}: {} buckets, {:.1f} MiB on the wire, staging 2 x {:.1f} MiB", m.plan->id,
            m.plan->buckets.size(), static_cast<double>(m.plan->wire_bytes()) / (1 << 20),
            static_cast<double>(m.plan->largest_bucket_numel() * m.plan->element_size()) / (1 << 20));
  return m.plan->id;
}

engine::WeightSink::Result WeightReceiver::receive(uint64_t version) {
  Impl& m = *impl_;
  Result r;
  const auto t0 = std::chrono::steady_clock::now();
  const Deadline deadline = Deadline::after_seconds(m.timeout_s);
  m.comm.set_timeout(m.timeout_s);
  const auto control = protocol::control_options(m.comm, m.device);
  const std::string what = fmt::format("weight sync to version {} (sync rank {})", version, m.comm.rank());

  // Header and votes: a failure here leaves the weights as they are.
  try {
    at::Tensor header = at::zeros({protocol::kHeaderWords}, control);
    m.comm.broadcast(header, 0)->wait(deadline);
    header = header.cpu();
    const int64_t* h = header.data_ptr<int64_t>();
    int64_t vote = protocol::kAccept;
    if (h[protocol::kMagicField] != protocol::kMagic) vote = protocol::kBadHeader;
    else if (!m.plan) vote = protocol::kNoPlan;
    else if (protocol::from_word(h[protocol::kPlanId]) != m.plan->id ||
             h[protocol::kBuckets] != static_cast<int64_t>(m.plan->buckets.size())) vote = protocol::kOtherPlan;
    else if (protocol::from_word(h[protocol::kVersion]) != version) vote = protocol::kNotExpecting;
    at::Tensor votes = at::zeros({m.comm.size()}, control);
    votes[m.comm.rank()].fill_(vote);
    m.comm.all_reduce(votes)->wait(deadline);
    if (votes.cpu().count_nonzero().item<int64_t>() != 0) {
      r.error = fmt::format("{} refused: {}; the weights are unchanged", what,
                            protocol::refusals(votes, m.plan ? m.plan->senders : 1));
      return r;
    }
  } catch (const std::exception& e) {
    r.error = fmt::format("{} failed before any weight changed: {}", what, e.what());
    return r;
  }

  const BucketPlan& p = *m.plan;
  bool comm_failed = false;
  try {
    c10::InferenceMode inference;  // the engine's weights are inference tensors
    protocol::SideStream copy(m.device);
    std::vector<dist::WorkPtr> works(p.buckets.size());
    auto issue = [&](size_t k) {
      // Issued from the copy stream: the receive waits for the copies out of this staging buffer
      // (bucket k - 2), not for those of bucket k - 1, which run while it arrives.
      works[k] = m.comm.broadcast(m.staging[k % 2].narrow(0, 0, p.buckets[k].numel), p.buckets[k].sender);
    };
    issue(0);
    for (size_t k = 0; k < p.buckets.size(); ++k) {
      if (k + 1 < p.buckets.size()) issue(k + 1);
      try {
        works[k]->wait_on_stream();
      } catch (const CommError&) {
        comm_failed = true;
        throw;
      }
      r.weights_changed = true;
      r.base_changed = r.base_changed || !p.adapters_only();
      m.placer.place(k, m.staging[k % 2].narrow(0, 0, p.buckets[k].numel));
    }
    for (auto& w : works) w->wait(deadline);
    copy.synchronize();
  } catch (const std::exception& e) {
    comm_failed = comm_failed || dynamic_cast<const CommError*>(&e) != nullptr;
    r.error = fmt::format("{} failed {}: {}", what, r.weights_changed ? "part way, the weights are incomplete" :
                                                                        "before any weight changed", e.what());
  }
  if (comm_failed) return r;
  try {
    at::Tensor done = at::full({1}, r.error.empty() ? 1 : 0, control);
    m.comm.all_reduce(done, dist::ReduceOp::kMin)->wait(deadline);
  } catch (const std::exception& e) {
    if (r.error.empty()) r.error = fmt::format("{}: the closing handshake failed: {}", what, e.what());
  }
  r.complete = r.error.empty();
  if (r.complete) {
    m.last.version = version;
    m.last.buckets = static_cast<int64_t>(p.buckets.size());
    m.last.wire_bytes = p.wire_bytes();
    m.last.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return r;
}

}  // namespace tiller::sync
