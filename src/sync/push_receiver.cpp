// The engine side of a pushed (delta) weight sync (weight_push.h).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>

#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include "sync/delta_codec.h"
#include "sync/slice_placer.h"
#include "sync/sync_protocol.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/communicator.h"
#include "tiller/engine/engine.h"
#include "tiller/sync/weight_push.h"

namespace tiller::sync {
namespace {

using Clock = std::chrono::steady_clock;

// What the leader broadcasts to its followers before each bucket: [bucket, elements]; a negative
// bucket ends the sync (kDone: complete, kFailed: not).
constexpr int64_t kDone = -1;
constexpr int64_t kFailed = -2;

// A chunk's payload can be no larger than this (zstd's bound for the sparse form's raw size).
uint64_t payload_bound(uint64_t bytes) { return 2 * bytes + 4096; }

}  // namespace

struct PushReceiver::Impl {
  engine::Engine& engine;
  dist::Communicator* tp;
  double timeout_s;
  at::Device device = at::kCPU;

  // Set by install_plan on the engine's thread, while no sync is open; read by take_chunk.
  std::optional<BucketPlan> plan;
  SlicePlacer placer;
  at::Tensor staging;            // the largest bucket, on the device (CUDA engines, TP followers)
  std::vector<uint64_t> bucket_bytes;
  int element_bytes = 2;

  mutable std::mutex mu;
  std::condition_variable cv;
  uint64_t open_version = 0;     // the sync take_chunk applies chunks to (0: none)
  // The leader's copy of every bucket (allocated at its first chunk), as last applied.
  std::vector<std::unique_ptr<uint8_t[]>> copies;
  // This sync: per bucket, the applied or in-progress byte ranges (offset -> bytes), the bytes
  // applied, and whether any chunk changed something.
  std::vector<std::map<uint64_t, uint64_t>> ranges;
  std::vector<uint64_t> applied;
  std::vector<bool> changed;
  std::deque<int64_t> ready;     // buckets whose every byte is applied, for receive() to place
  std::vector<bool> on_device;   // the weights hold the copy of this bucket
  uint64_t drops_seen = 0;       // the engine's weight_drops() when on_device was last right
  PushReceiveStats stats;

  Impl(engine::Engine& e, dist::Communicator* c, double t) : engine(e), tp(c), timeout_s(t) {}

  bool follower() const { return tp && tp->rank() != 0; }
  bool tensor_parallel() const { return tp && tp->size() > 1; }

  // Bucket k's bytes (the first numel elements of `src`, on any device) into this rank's weights.
  void place(size_t k, const at::Tensor& src) {
    c10::InferenceMode inference;
    placer.place(k, src);
  }

  at::Tensor host_bucket(size_t k) {
    const BucketPlan& p = *plan;
    return at::from_blob(copies[k].get(), {p.buckets[k].numel},
                         at::TensorOptions().dtype(protocol::wire_scalar_type(p.wire_dtype)));
  }

  void announce(int64_t bucket, int64_t numel, Deadline deadline) {
    at::Tensor h = at::tensor(std::vector<int64_t>{bucket, numel}, at::kLong)
                       .to(protocol::control_options(*tp, device).device());
    tp->broadcast(h, 0)->wait(deadline);
  }

  Result receive_leader(uint64_t version);
  Result receive_follower(uint64_t version);
};

PushReceiver::PushReceiver(engine::Engine& engine, dist::Communicator* tp, double timeout_s)
    : impl_(std::make_unique<Impl>(engine, tp, timeout_s)) {
  impl_->device = at::Device(engine.options().device);
}

PushReceiver::~PushReceiver() = default;

uint64_t PushReceiver::plan_id() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->plan ? impl_->plan->id : 0;
}

PushReceiveStats PushReceiver::last() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

uint64_t PushReceiver::install_plan(const std::string& text) {
  Impl& m = *impl_;
  BucketPlan p = BucketPlan::from_json(text, "weight sync plan");
  SlicePlacer placer(p, m.engine);  // ConfigError naming what does not fit this rank's weights
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.open_version != 0)
    throw ConfigError(fmt::format("a pushed sync to version {} is in progress; install the plan after it",
                                  m.open_version));
  const bool same = m.plan && m.plan->id == p.id;
  const auto wire = protocol::wire_scalar_type(p.wire_dtype);
  if (m.device.is_cuda() || m.tensor_parallel())
    m.staging = at::empty({p.largest_bucket_numel()}, at::TensorOptions().dtype(wire).device(m.device));
  m.element_bytes = static_cast<int>(p.element_size());
  m.bucket_bytes.clear();
  for (const auto& b : p.buckets) m.bucket_bytes.push_back(static_cast<uint64_t>(b.numel) * p.element_size());
  if (!same) {  // another plan cuts the model elsewhere: the copies start over (the next push is full)
    m.copies.clear();
    m.copies.resize(p.buckets.size());
    m.on_device.assign(p.buckets.size(), false);
  }
  m.ranges.assign(p.buckets.size(), {});
  m.applied.assign(p.buckets.size(), 0);
  m.changed.assign(p.buckets.size(), false);
  m.placer = std::move(placer);
  m.plan = std::move(p);
  log::info("pushed weight sync plan {:016x}: {} buckets, {:.1f} MiB of weights{}", m.plan->id, m.plan->buckets.size(),
            static_cast<double>(m.plan->wire_bytes()) / (1 << 20),
            m.follower() ? "" : "; the leader keeps a host copy of them");
  return m.plan->id;
}

std::string PushReceiver::take_chunk(const engine::WeightChunk& c, double wait_s) {
  Impl& m = *impl_;
  if (m.follower()) throw engine::InvalidRequest("pushed chunks go to the engine's TP leader");
  std::unique_lock<std::mutex> lock(m.mu);
  // Begin's answer reaches the pusher before the engine's loop enters receive(): wait for it a little.
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(std::min(wait_s, 60.0)));
  if (!m.cv.wait_until(lock, until, [&] { return m.open_version == c.version; }))
    throw engine::InvalidRequest(fmt::format(
        "chunk of bucket {} for version {}: no pushed sync to that version is in progress ({}); call "
        "BeginWeightUpdate with the plan's id first",
        c.bucket, c.version, m.open_version ? fmt::format("version {} is", m.open_version) : std::string("none is")));
  const BucketPlan& p = *m.plan;
  if (c.plan_id != p.id)
    throw engine::InvalidRequest(fmt::format("chunk of plan {:016x}: the engine's plan is {:016x}", c.plan_id, p.id));
  if (c.bucket < 0 || static_cast<size_t>(c.bucket) >= p.buckets.size())
    throw engine::InvalidRequest(fmt::format("chunk of bucket {}: the plan has {}", c.bucket, p.buckets.size()));
  const size_t k = static_cast<size_t>(c.bucket);
  if (c.sender != p.buckets[k].sender)
    throw engine::InvalidRequest(fmt::format("chunk of bucket {} from actor rank {}: the plan's sender is rank {}",
                                             k, c.sender, p.buckets[k].sender));
  const uint64_t n = m.bucket_bytes[k];
  const uint64_t e = static_cast<uint64_t>(m.element_bytes);
  if (c.bytes == 0 || c.bytes > kMaxPushChunkBytes || c.offset > n || c.bytes > n - c.offset || c.offset % e != 0 ||
      c.bytes % e != 0)
    throw engine::InvalidRequest(fmt::format("chunk of bucket {} at byte {} of {} bytes: outside the bucket's {} bytes "
                                             "or not whole {}-byte elements",
                                             k, c.offset, c.bytes, n, e));
  if (c.form < 0 || c.form > 2 || c.payload.size() > payload_bound(c.bytes))
    throw engine::InvalidRequest(fmt::format("chunk of bucket {} at byte {}: form {} with a {}-byte payload", k,
                                             c.offset, c.form, c.payload.size()));
  auto& r = m.ranges[k];
  auto next = r.lower_bound(c.offset);
  const bool overlaps = (next != r.end() && next->first < c.offset + c.bytes) ||
                        (next != r.begin() && std::prev(next)->first + std::prev(next)->second > c.offset);
  if (overlaps)
    throw engine::InvalidRequest(fmt::format("chunk of bucket {} at byte {}: overlaps a chunk already applied", k,
                                             c.offset));
  r.emplace(c.offset, c.bytes);  // reserved while it decodes
  if (!m.copies[k]) m.copies[k].reset(new uint8_t[n]());  // zeros: the first chunk of it must be full
  uint8_t* dst = m.copies[k].get() + c.offset;
  lock.unlock();

  std::string refused;
  try {  // the payload read where it arrived, not copied
    decode_bucket(static_cast<DeltaForm>(c.form), c.bytes, c.base_hash, c.hash, c.payload, dst, c.bytes,
                  m.element_bytes);
  } catch (const DeltaMismatch& err) {
    refused = fmt::format("bucket {} at byte {}: {}", k, c.offset, err.what());
  }

  lock.lock();
  if (!refused.empty()) {
    m.ranges[k].erase(c.offset);
    ++m.stats.refused_chunks;
    return refused;
  }
  m.applied[k] += c.bytes;
  if (c.changed > 0 || c.form == static_cast<int>(DeltaForm::kFull)) m.changed[k] = true;
  ++m.stats.chunks;
  m.stats.payload_bytes += static_cast<int64_t>(c.payload.size());
  if (m.applied[k] == n) {
    m.ready.push_back(static_cast<int64_t>(k));
    m.cv.notify_all();
  }
  return "";
}

engine::WeightSink::Result PushReceiver::receive(uint64_t version) {
  return impl_->follower() ? impl_->receive_follower(version) : impl_->receive_leader(version);
}

engine::WeightSink::Result PushReceiver::Impl::receive_leader(uint64_t version) {
  Result r;
  const auto t0 = Clock::now();
  const Deadline deadline = Deadline::after_seconds(timeout_s);
  const std::string what = fmt::format("pushed weight sync to version {}", version);
  size_t buckets = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    stats = PushReceiveStats{};
    stats.version = version;
    if (!plan) {
      r.error = fmt::format("{}: no sync plan is installed; the weights are unchanged", what);
    } else {
      buckets = plan->buckets.size();
      for (auto& x : ranges) x.clear();
      std::fill(applied.begin(), applied.end(), 0);
      std::fill(changed.begin(), changed.end(), false);
      ready.clear();
      // Weights dropped by a sleep since the last sync hold nothing: every bucket is placed again.
      if (engine.weight_drops() != drops_seen) {
        std::fill(on_device.begin(), on_device.end(), false);
        drops_seen = engine.weight_drops();
      }
      open_version = version;
    }
  }
  cv.notify_all();
  if (!plan) {
    if (tensor_parallel()) announce(kFailed, 0, deadline);
    return r;
  }
  size_t done = 0;
  try {
    while (done < buckets) {
      int64_t k = -1;
      {
        std::unique_lock<std::mutex> lock(mu);
        const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(deadline.remaining_seconds()));
        if (!cv.wait_until(lock, until, [&] { return !ready.empty(); })) {
          std::vector<size_t> missing;
          for (size_t b = 0; b < buckets; ++b)
            if (applied[b] != bucket_bytes[b]) missing.push_back(b);
          throw TimeoutError(fmt::format("{} buckets of {} did not arrive within {} s (bucket {} first)",
                                         missing.size(), buckets, timeout_s, missing.empty() ? 0 : missing.front()));
        }
        k = ready.front();
        ready.pop_front();
      }
      ++done;
      const size_t b = static_cast<size_t>(k);
      if (!changed[b] && on_device[b]) continue;  // the weights already hold these bytes
      on_device[b] = false;
      r.weights_changed = true;
      r.base_changed = r.base_changed || !plan->adapters_only();
      const int64_t numel = plan->buckets[b].numel;
      if (staging.defined()) {
        at::Tensor stage = staging.narrow(0, 0, numel);
        stage.copy_(host_bucket(b));
        if (tensor_parallel()) {
          announce(k, numel, deadline);
          tp->broadcast(stage, 0)->wait(deadline);
        }
        place(b, stage);
      } else {
        place(b, host_bucket(b));
      }
      on_device[b] = true;
      std::lock_guard<std::mutex> lock(mu);
      ++stats.buckets_placed;
    }
    if (tensor_parallel()) announce(kDone, 0, deadline);
  } catch (const std::exception& e) {
    r.error = fmt::format("{} failed {}: {}", what,
                          r.weights_changed ? "part way, the weights are incomplete" : "before any weight changed",
                          e.what());
    if (tensor_parallel()) {
      try {
        announce(kFailed, 0, deadline);
      } catch (const std::exception&) {  // the communicator failed: the followers time out on their own
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    open_version = 0;  // later chunks of this version are refused
    stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  r.complete = r.error.empty();
  return r;
}

engine::WeightSink::Result PushReceiver::Impl::receive_follower(uint64_t version) {
  Result r;
  const Deadline deadline = Deadline::after_seconds(timeout_s);
  const std::string what = fmt::format("pushed weight sync to version {} (TP rank {})", version, tp->rank());
  try {
    if (!plan) throw ConfigError("no sync plan is installed");
    const at::Tensor header_like = at::zeros({2}, protocol::control_options(*tp, device));
    for (;;) {
      at::Tensor h = header_like.clone();
      tp->broadcast(h, 0)->wait(deadline);
      h = h.cpu();
      const int64_t k = h[0].item<int64_t>(), numel = h[1].item<int64_t>();
      if (k == kDone) break;
      if (k == kFailed) throw Error("the leader's receive failed (see its log)");
      if (k < 0 || static_cast<size_t>(k) >= plan->buckets.size() || numel != plan->buckets[k].numel)
        throw Error(fmt::format("the leader announced bucket {} of {} elements, which the plan does not have", k, numel));
      at::Tensor stage = staging.narrow(0, 0, numel);
      tp->broadcast(stage, 0)->wait(deadline);
      r.weights_changed = true;
      r.base_changed = r.base_changed || !plan->adapters_only();
      place(static_cast<size_t>(k), stage);
    }
  } catch (const std::exception& e) {
    r.error = fmt::format("{} failed {}: {}", what,
                          r.weights_changed ? "part way, the weights are incomplete" : "before any weight changed",
                          e.what());
  }
  r.complete = r.error.empty();
  return r;
}

}  // namespace tiller::sync
