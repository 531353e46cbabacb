// The actor side of a pushed (delta) weight sync (weight_push.h).
//
// For each of this rank's buckets: pack it (and convert it to the wire dtype) on the actor's
// device, copy it to one of two host buffers, and hand its chunks to the encoding threads; the
// next bucket is packed while they encode. Each thread encodes a chunk once, against the base,
// writes it on its own stream to every engine, and moves the base on to the new bytes. When every
// bucket is out, the streams end and each engine answers with the chunks it could not apply; those
// go again in full, from the base, which now holds the new bytes.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <deque>
#include <mutex>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "sync/bucket_packer.h"
#include "sync/delta_codec.h"
#include "sync/sync_protocol.h"
#include "tiller/core/config.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/engine/server.h"
#include "tiller/sync/weight_push.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::sync {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

engine::WeightChunk to_chunk(EncodedBucket&& e, uint64_t version, uint64_t plan_id, int sender, size_t bucket,
                             uint64_t offset) {
  engine::WeightChunk c;
  c.version = version;
  c.plan_id = plan_id;
  c.sender = sender;
  c.bucket = static_cast<int>(bucket);
  c.offset = offset;
  c.bytes = e.bytes;
  c.form = static_cast<int>(e.form);
  c.base_hash = e.base_hash;
  c.hash = e.hash;
  c.changed = e.changed;
  c.payload = std::move(e.payload);
  return c;
}

}  // namespace

std::string standalone_engine_token(const std::string& token_file) {
  if (token_file.empty()) {
    const char* env = std::getenv("TILLER_ENGINE_TOKEN");
    return env ? env : "";
  }
  std::ifstream in(token_file);
  std::string token;
  if (!in || !std::getline(in, token) || token.empty())
    throw ConfigError(fmt::format("{}: cannot read a token from its first line", token_file));
  return token;
}

engine::ClientOptions standalone_engine_client(const JobConfig& job, const std::string& address) {
  engine::ClientOptions o;
  o.address = address;
  o.token = standalone_engine_token(job.engines.token_file);
  o.timeout_seconds = job.timeouts.rpc_s;
  if (!job.engines.tls_cert.empty()) {
    o.tls.ca = job.engines.tls_ca.empty() ? job.engines.tls_cert : job.engines.tls_ca;
    o.tls.server_name = job.engines.tls_server_name;
  }
  return o;
}

bool PushStats::all_succeeded() const {
  return std::all_of(failed.begin(), failed.end(), [](const std::string& f) { return f.empty(); });
}

struct WeightPusher::Impl {
  zero::ShardedModel& actor;
  BucketPlan plan;
  PushOptions opts;
  BucketPacker packer;
  int rank = 0;
  int threads = 1;
  int64_t element_bytes = 2;
  std::vector<size_t> mine;                          // this rank's buckets, in order
  std::vector<std::unique_ptr<uint8_t[]>> base;      // per bucket: its bytes as last pushed
  std::array<at::Tensor, 2> host;                    // the packed buckets on the host

  Impl(zero::ShardedModel& a, BucketPlan p, PushOptions o)
      : actor(a), plan(std::move(p)), opts(std::move(o)), packer(plan, actor, "weight push") {}

  uint64_t bucket_bytes(size_t k) const { return static_cast<uint64_t>(plan.buckets[k].numel) * element_bytes; }
};

WeightPusher::WeightPusher(zero::ShardedModel& actor, BucketPlan plan, PushOptions opts)
    : impl_(std::make_unique<Impl>(actor, std::move(plan), std::move(opts))) {
  Impl& m = *impl_;
  if (m.plan.senders != actor.world())
    throw ConfigError(fmt::format("weight push: the plan is for {} actor ranks and the actor group has {}",
                                  m.plan.senders, actor.world()));
  m.element_bytes = m.plan.element_size();
  const PushOptions& o = m.opts;
  if (o.chunk_bytes < (64u << 10) || o.chunk_bytes > kMaxPushChunkBytes ||
      o.chunk_bytes % static_cast<uint64_t>(m.element_bytes) != 0)
    throw ConfigError(fmt::format("weight push: chunks of {} bytes: allowed 64 KiB to {} MiB, whole {}-byte elements",
                                  o.chunk_bytes, kMaxPushChunkBytes >> 20, m.element_bytes));
  if (o.threads < 0 || o.threads > 256)
    throw ConfigError(fmt::format("weight push: {} threads: allowed 0 (the hardware's) to 256", o.threads));
  if (o.zstd_level < 1 || o.zstd_level > 19)
    throw ConfigError(fmt::format("weight push: zstd level {}: allowed 1 to 19", o.zstd_level));
  if (!(o.timeout_s > 0)) throw ConfigError(fmt::format("weight push: timeout {} s: must be positive", o.timeout_s));
  m.threads = o.threads > 0 ? o.threads : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 16);
  m.rank = actor.rank();
  m.base.resize(m.plan.buckets.size());
  int64_t largest = 0;
  for (size_t k = 0; k < m.plan.buckets.size(); ++k)
    if (m.plan.buckets[k].sender == m.rank) {
      m.mine.push_back(k);
      largest = std::max(largest, m.plan.buckets[k].numel);
    }
  const auto opts_host = at::TensorOptions().dtype(protocol::wire_scalar_type(m.plan.wire_dtype));
  for (auto& h : m.host)
    h = at::empty({std::max<int64_t>(largest, 1)}, m.packer.device().is_cuda() ? opts_host.pinned_memory(true) : opts_host);
}

WeightPusher::~WeightPusher() = default;

const BucketPlan& WeightPusher::plan() const { return impl_->plan; }

PushStats WeightPusher::push(uint64_t version, const std::vector<PushTarget>& engines) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  const Deadline deadline = Deadline::after_seconds(m.opts.timeout_s);
  const size_t E = engines.size();
  PushStats st;
  st.version = version;
  st.failed.assign(E, "");
  if (E == 0) return st;

  struct Job {
    size_t bucket = 0;
    uint64_t offset = 0, bytes = 0;
    const uint8_t* src = nullptr;
    bool delta = false;  // the base holds the bucket's previous bytes
  };
  std::mutex mu;  // guards jobs, pending, closing and st.failed
  std::condition_variable cv;
  std::deque<Job> jobs;
  size_t pending = 0;  // jobs queued or being encoded
  bool closing = false;
  std::atomic<int64_t> chunks{0}, sent{0}, nfull{0}, nxor{0}, nsparse{0}, changed{0}, encode_ns{0};

  auto fail = [&](size_t j, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (st.failed[j].empty()) st.failed[j] = why;
  };
  auto failed = [&](size_t j) {
    std::lock_guard<std::mutex> lock(mu);
    return !st.failed[j].empty();
  };
  // Writes `c` to engine j on `s` (opened on first use); a broken stream fails the engine, with the
  // engine's status once the stream is finished.
  auto write = [&](std::unique_ptr<engine::WeightPushStream>& s, size_t j, const engine::WeightChunk& c) {
    if (failed(j)) return;
    try {
      if (!s) s = engines[j].client->push_weights(deadline);
      if (s->write(c)) {
        sent += static_cast<int64_t>(c.payload.size());
        return;
      }
      const auto broken = std::move(s);  // finished here, never again below
      broken->finish();                  // throws the stream's status
      fail(j, fmt::format("{}: the push stream closed early", engines[j].name));
    } catch (const std::exception& e) {
      s.reset();  // cancelled unless finished
      fail(j, fmt::format("{}: {}", engines[j].name, e.what()));
    }
  };

  // Each thread's streams, one per engine; their answers come after the last bucket.
  std::vector<std::vector<std::unique_ptr<engine::WeightPushStream>>> streams(m.threads);
  for (auto& s : streams) s.resize(E);
  auto worker = [&](int w) {
    DeltaOptions dopts;
    dopts.element_bytes = static_cast<int>(m.element_bytes);
    dopts.zstd_level = m.opts.zstd_level;
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !jobs.empty() || closing; });
        if (jobs.empty()) return;
        job = jobs.front();
        jobs.pop_front();
      }
      try {
        const auto te = Clock::now();
        uint8_t* base = m.base[job.bucket].get() + job.offset;
        EncodedBucket enc = encode_bucket(job.src, job.delta ? base : nullptr, job.bytes, dopts);
        std::memcpy(base, job.src, job.bytes);  // the base moves on: a resend is of these bytes
        encode_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - te).count();
        ++chunks;
        changed += static_cast<int64_t>(enc.changed);
        (enc.form == DeltaForm::kFull ? nfull : enc.form == DeltaForm::kXor ? nxor : nsparse) += 1;
        const engine::WeightChunk c = to_chunk(std::move(enc), version, m.plan.id, m.rank, job.bucket, job.offset);
        for (size_t j = 0; j < E; ++j) {
          if (m.opts.on_chunk) {
            engine::WeightChunk damaged = c;
            m.opts.on_chunk(j, damaged);
            write(streams[w][j], j, damaged);
          } else {
            write(streams[w][j], j, c);
          }
        }
      } catch (const std::exception& e) {  // an encoding error fails every engine: the bucket cannot go
        for (size_t j = 0; j < E; ++j) fail(j, fmt::format("{}: encoding bucket {}: {}", engines[j].name, job.bucket, e.what()));
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        --pending;
      }
      cv.notify_all();
    }
  };
  std::vector<std::thread> pool;
  for (int w = 0; w < m.threads; ++w) pool.emplace_back(worker, w);
  auto wait_idle = [&] {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return pending == 0; });
  };

  // Pack bucket i into host buffer i % 2 while the threads encode bucket i - 1 from the other.
  std::string pack_error;
  try {
    for (size_t i = 0; i < m.mine.size(); ++i) {
      const size_t k = m.mine[i];
      const auto tp = Clock::now();
      at::Tensor& h = m.host[i % 2];
      m.packer.pack(k, m.rank);
      h.narrow(0, 0, m.plan.buckets[k].numel).copy_(m.packer.buffer(k));
      st.pack_seconds += since(tp);
      wait_idle();  // bucket i - 1's chunks are out: its buffer (i - 1) % 2 is free for bucket i + 1
      const uint64_t n = m.bucket_bytes(k);
      const bool delta = m.opts.delta && m.base[k] != nullptr;
      if (!m.base[k]) m.base[k].reset(new uint8_t[std::max<uint64_t>(n, 1)]);
      const auto* src = static_cast<const uint8_t*>(h.data_ptr());
      {
        std::lock_guard<std::mutex> lock(mu);
        for (uint64_t off = 0; off < n; off += m.opts.chunk_bytes) {
          jobs.push_back({k, off, std::min(m.opts.chunk_bytes, n - off), src + off, delta});
          ++pending;
        }
      }
      cv.notify_all();
      st.raw_bytes += static_cast<int64_t>(n);
      ++st.buckets;
      if (deadline.expired()) throw TimeoutError(fmt::format("the push did not finish within {} s", m.opts.timeout_s));
    }
  } catch (const std::exception& e) {
    pack_error = e.what();
  }
  wait_idle();
  {
    std::lock_guard<std::mutex> lock(mu);
    closing = true;
  }
  cv.notify_all();
  for (auto& t : pool) t.join();
  if (!pack_error.empty())
    for (size_t j = 0; j < E; ++j) fail(j, fmt::format("{}: packing the buckets failed: {}", engines[j].name, pack_error));

  // The answers; then what an engine could not apply, again in full from the base.
  std::vector<std::vector<std::pair<int, uint64_t>>> again(E);
  for (auto& per_thread : streams)
    for (size_t j = 0; j < E; ++j) {
      if (!per_thread[j]) continue;
      try {
        const engine::PushAnswer a = per_thread[j]->finish();
        if (!a.resend.empty())
          log::warn("weight push {}: {} chunk(s) to push again in full ({})", engines[j].name, a.resend.size(), a.reason);
        again[j].insert(again[j].end(), a.resend.begin(), a.resend.end());
      } catch (const std::exception& e) {
        fail(j, fmt::format("{}: {}", engines[j].name, e.what()));
      }
    }
  DeltaOptions full;
  full.element_bytes = static_cast<int>(m.element_bytes);
  full.zstd_level = m.opts.zstd_level;
  for (size_t j = 0; j < E; ++j) {
    if (again[j].empty() || failed(j)) continue;
    std::unique_ptr<engine::WeightPushStream> s;
    for (const auto& [bucket, offset] : again[j]) {
      const size_t k = static_cast<size_t>(bucket);
      if (k >= m.base.size() || !m.base[k] || offset >= m.bucket_bytes(k)) {
        fail(j, fmt::format("{}: it asked again for bucket {} at byte {}, which this rank did not push",
                            engines[j].name, bucket, offset));
        break;
      }
      const uint64_t bytes = std::min(m.opts.chunk_bytes, m.bucket_bytes(k) - offset);
      try {
        write(s, j, to_chunk(encode_bucket(m.base[k].get() + offset, nullptr, bytes, full), version, m.plan.id, m.rank, k,
                             offset));
      } catch (const std::exception& e) {
        fail(j, fmt::format("{}: encoding bucket {} at byte {} again: {}", engines[j].name, k, offset, e.what()));
        break;
      }
      ++st.resent_chunks;
    }
    if (!s || failed(j)) continue;
    try {
      const engine::PushAnswer a = s->finish();
      if (!a.resend.empty())
        fail(j, fmt::format("{}: {} chunk(s) could not be applied even in full: {}", engines[j].name, a.resend.size(),
                            a.reason));
    } catch (const std::exception& e) {
      fail(j, fmt::format("{}: {}", engines[j].name, e.what()));
    }
  }
  st.chunks = chunks;
  st.sent_bytes = sent;
  st.full_chunks = nfull;
  st.xor_chunks = nxor;
  st.sparse_chunks = nsparse;
  st.changed_elements = changed;
  st.encode_seconds = static_cast<double>(encode_ns.load()) * 1e-9;
  st.seconds = since(t0);
  return st;
}

}  // namespace tiller::sync
