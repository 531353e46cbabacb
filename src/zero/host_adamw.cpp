#include "tiller/zero/host_adamw.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Half.h>

#include "tiller/core/error.h"

namespace tiller::zero {

AdamWScalars AdamWScalars::make(const AdamWConfig& cfg, double lr, int64_t t, double grad_factor, bool decay) {
  TILLER_CHECK(t >= 1, "AdamW step {}: steps count from 1", t);
  AdamWScalars s;
  s.beta1 = static_cast<float>(cfg.beta1);
  s.beta2 = static_cast<float>(cfg.beta2);
  s.eps = static_cast<float>(cfg.eps);
  // As torch.optim.AdamW's param.mul_(1 - lr * weight_decay); exactly 1 without decay, so a
  // parameter is left as the Adam step leaves it (inf included).
  s.decay = decay ? static_cast<float>(1.0 - lr * cfg.weight_decay) : 1.0f;
  const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(t));
  s.step_size = static_cast<float>(lr / bc1);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  // As ShardAdamW hands the clipping factor to the fused kernel: a scale the gradients are divided by.
  s.grad_scale = grad_factor == 1.0 ? 1.0f : static_cast<float>(1.0 / grad_factor);
  return s;
}

namespace {

// One clone per vector width where GCC can make them (the loaders pick by the CPU at start-up).
// This file is compiled with -O3 -fno-math-errno -ffp-contract=off (src/CMakeLists.txt): sqrt and
// division vectorise, and no width contracts a multiply-add, so every clone gives the same bits.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TILLER_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TILLER_VECTOR_CLONES
#endif

// The element update; STORE writes `pi` (the new parameter) to the rounded output.
#define TILLER_ADAMW_LOOP(NAME, OUT_T, STORE)                                                                   \
  TILLER_VECTOR_CLONES void NAME(float* __restrict p, const float* __restrict g, float* __restrict m,          \
                                 float* __restrict v, int64_t n, AdamWScalars s, OUT_T* __restrict out) {      \
    const float one_minus_b1 = 1.0f - s.beta1, one_minus_b2 = 1.0f - s.beta2;                                  \
    for (int64_t i = 0; i < n; ++i) {                                                                          \
      const float gi = g[i] / s.grad_scale;                                                                    \
      float pi = p[i] * s.decay;                                                                               \
      const float mi = s.beta1 * m[i] + one_minus_b1 * gi;                                                     \
      const float vi = s.beta2 * v[i] + one_minus_b2 * gi * gi;                                                \
      m[i] = mi;                                                                                               \
      v[i] = vi;                                                                                               \
      const float denom = std::sqrt(vi) / s.bias_correction2_sqrt + s.eps;                                     \
      pi = pi - s.step_size * mi / denom;                                                                      \
      p[i] = pi;                                                                                               \
      STORE;                                                                                                   \
    }                                                                                                          \
  }

// bf16 as c10::BFloat16's constructor rounds: to nearest even, NaN to the quiet NaN 0x7FC0.
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

TILLER_ADAMW_LOOP(update_only, float, (void)out)
TILLER_ADAMW_LOOP(update_fp32_out, float, out[i] = pi)
TILLER_ADAMW_LOOP(update_bf16_out, uint16_t, out[i] = round_bf16(pi))

// A fixed team of threads that runs one job at a time: part k of `parts` on thread k, the caller
// taking part 0. The job must not throw.
class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int k = 1; k < threads; ++k) workers_.emplace_back([this, k] { loop(k); });
  }
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(const std::function<void(int part, int parts)>& job) {
    if (workers_.empty()) return job(0, 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      pending_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    job(0, size());
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop(int k) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int, int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      (*job)(k, size());
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int, int)>* job_ = nullptr;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Chunks are multiples of this many elements (128 bytes of fp32), so blocks never share a cache line.
constexpr int64_t kPartAlign = 32;
// Elements a thread updates at a time (256 KiB of each fp32 stream): a multiple of kPartAlign.
constexpr int64_t kBlock = int64_t{1} << 16;
// Staged chunks in flight each way (a chunk's copy in, the update of another, a third's copy out).
constexpr int kSlots = 3;

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

RoundedOut rounded_out(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return RoundedOut::kBFloat16;
    case at::kHalf: return RoundedOut::kHalf;
    case at::kFloat: return RoundedOut::kFloat;
    default: TILLER_CHECK(false, "host AdamW: compute shards of {} are not supported", c10::toString(t));
  }
  return RoundedOut::kNone;
}

}  // namespace

void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWScalars& s,
                  void* out, RoundedOut out_kind) {
  switch (out_kind) {
    case RoundedOut::kNone: return update_only(param, grad, exp_avg, exp_avg_sq, n, s, nullptr);
    case RoundedOut::kFloat: return update_fp32_out(param, grad, exp_avg, exp_avg_sq, n, s, static_cast<float*>(out));
    case RoundedOut::kBFloat16:
      return update_bf16_out(param, grad, exp_avg, exp_avg_sq, n, s, static_cast<uint16_t*>(out));
    case RoundedOut::kHalf: {
      update_only(param, grad, exp_avg, exp_avg_sq, n, s, nullptr);
      auto* h = static_cast<c10::Half*>(out);
      for (int64_t i = 0; i < n; ++i) h[i] = c10::Half(param[i]);
      return;
    }
  }
}

int default_optimizer_threads() {
  int local = 1;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"}) {
    if (const char* v = std::getenv(var)) {
      local = std::max(1, std::atoi(v));
      break;
    }
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / local);
}

struct HostAdamW::Impl {
  struct Run {
    int64_t begin = 0, end = 0;
    bool decay = false;
  };
  struct Shard {
    at::Tensor master, exp_avg, exp_avg_sq;
    std::vector<Run> runs;  // of equal decay, covering [0, numel)
  };
  AdamWConfig cfg;
  at::Device device;
  bool copies = false;  // the device is not the host: chunks are staged through pinned memory
  int64_t chunk = 0;
  WorkerPool pool;
  std::vector<Shard> shards;
  int64_t steps = 0;
  // Staging (copies only): per slot, the gradient chunk in and the rounded chunk out.
  std::vector<at::Tensor> grad_stage, out_stage;
  Timing timing;

  Impl(AdamWConfig c, at::Device d, int threads, int64_t ch)
      : cfg(c), device(d), copies(!d.is_cpu()), chunk(ch), pool(threads) {}

  // Updates elements [b, b + n) of shard `i` from `grad` (n elements), writing the rounded values
  // to `out` (n elements of `kind`), on every thread of the pool.
  void update(size_t i, int64_t b, int64_t n, const float* grad, void* out, RoundedOut kind, const AdamWScalars& decayed,
              const AdamWScalars& plain) {
    Shard& s = shards[i];
    float* p = s.master.data_ptr<float>() + b;
    float* m = s.exp_avg.data_ptr<float>() + b;
    float* v = s.exp_avg_sq.data_ptr<float>() + b;
    const size_t out_size = kind == RoundedOut::kBFloat16 || kind == RoundedOut::kHalf ? 2 : 4;
    // Blocks handed out in order to whichever thread asks next: a thread the scheduler holds back
    // (the ranks of a node share its cores with their other threads) delays one block, not the
    // whole chunk, as a split into one fixed part per thread would.
    std::atomic<int64_t> next{0};
    pool.run([&](int, int) {
      for (;;) {
        const int64_t lo = next.fetch_add(kBlock, std::memory_order_relaxed);
        if (lo >= n) return;
        const int64_t hi = std::min(n, lo + kBlock);
        // The decay runs that meet [b + lo, b + hi).
        for (const Run& r : s.runs) {
          const int64_t x = std::max(lo, r.begin - b), y = std::min(hi, r.end - b);
          if (x >= y) continue;
          void* o = kind == RoundedOut::kNone ? nullptr : static_cast<char*>(out) + x * out_size;
          adamw_update(p + x, grad + x, m + x, v + x, y - x, r.decay ? decayed : plain, o, kind);
        }
      }
    });
  }
};

HostAdamW::HostAdamW(AdamWConfig cfg, at::Device device, int threads, int64_t chunk_elements)
    : impl_(std::make_unique<Impl>(cfg, device, std::max(1, threads), chunk_elements)) {
  TILLER_CHECK(chunk_elements > 0 && chunk_elements % kPartAlign == 0,
               "host AdamW: chunks of {} elements (a positive multiple of {})", chunk_elements, kPartAlign);
}

HostAdamW::~HostAdamW() = default;

size_t HostAdamW::add(int64_t numel, const at::Tensor& decay_mask) {
  Impl& m = *impl_;
  TILLER_CHECK(numel > 0 && decay_mask.numel() == numel, "host AdamW: a shard of {} elements with a mask of {}", numel,
               decay_mask.numel());
  Impl::Shard s;
  const auto host = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  s.master = at::zeros({numel}, host);
  s.exp_avg = at::zeros({numel}, host);
  s.exp_avg_sq = at::zeros({numel}, host);
  const at::Tensor mask = decay_mask.to(at::kCPU, at::kFloat).contiguous();
  const float* mk = mask.data_ptr<float>();
  for (int64_t b = 0; b < numel;) {
    int64_t e = b + 1;
    while (e < numel && (mk[e] != 0) == (mk[b] != 0)) ++e;
    s.runs.push_back({b, e, mk[b] != 0});
    b = e;
  }
  m.shards.push_back(std::move(s));
  return m.shards.size() - 1;
}

void HostAdamW::step(double lr, double grad_factor, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& compute) {
  Impl& m = *impl_;
  TILLER_CHECK(grads.size() == m.shards.size() && compute.size() == m.shards.size(),
               "host AdamW: {} gradients and {} compute shards for {} shards", grads.size(), compute.size(),
               m.shards.size());
  for (size_t i = 0; i < m.shards.size(); ++i) {
    const int64_t n = m.shards[i].master.numel();
    TILLER_CHECK(grads[i].scalar_type() == at::kFloat && grads[i].numel() == n && grads[i].is_contiguous() &&
                     compute[i].numel() == n && compute[i].is_contiguous() && grads[i].device() == m.device &&
                     compute[i].device() == m.device,
                 "host AdamW: shard {} of {} elements: gradient {} {} and compute shard {} {} on {}", i, n,
                 grads[i].numel(), c10::toString(grads[i].scalar_type()), compute[i].numel(),
                 c10::toString(compute[i].scalar_type()), m.device.str());
  }
  const auto t0 = Clock::now();
  m.timing = {};
  ++m.steps;
  const AdamWScalars decayed = AdamWScalars::make(m.cfg, lr, m.steps, grad_factor, true);
  const AdamWScalars plain = AdamWScalars::make(m.cfg, lr, m.steps, grad_factor, false);

  // Chunks in shard order (the forward's order: the first units are back first).
  struct Chunk {
    size_t shard;
    int64_t begin, n;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < m.shards.size(); ++i)
    for (int64_t b = 0, n = m.shards[i].master.numel(); b < n; b += m.chunk) chunks.push_back({i, b, std::min(m.chunk, n - b)});

  if (!m.copies) {  // host tensors: update in place, no staging
    for (const Chunk& c : chunks) {
      const at::Tensor& out = compute[c.shard];
      const RoundedOut kind = rounded_out(out.scalar_type());
      const auto u0 = Clock::now();
      m.update(c.shard, c.begin, c.n, grads[c.shard].data_ptr<float>() + c.begin,
               static_cast<char*>(out.data_ptr()) + c.begin * out.element_size(), kind, decayed, plain);
      m.timing.update_s += since(u0);
    }
    m.timing.total_s = since(t0);
    return;
  }

  const at::ScalarType out_dtype = compute.front().scalar_type();
  for (const auto& c : compute)
    TILLER_CHECK(c.scalar_type() == out_dtype, "host AdamW: compute shards of {} and {}", c10::toString(out_dtype),
                 c10::toString(c.scalar_type()));
  const RoundedOut kind = rounded_out(out_dtype);
  // Pinned memory and copies in the device's context, whatever the calling thread stands on.
  c10::DeviceGuard on_device(m.device);
  if (m.grad_stage.empty()) {
    const auto pinned = at::TensorOptions().device(at::kCPU).pinned_memory(true);
    for (int k = 0; k < kSlots; ++k) {
      m.grad_stage.push_back(at::empty({m.chunk}, pinned.dtype(at::kFloat)));
      m.out_stage.push_back(at::empty({m.chunk}, pinned.dtype(out_dtype)));
    }
  }
  if (m.out_stage.front().scalar_type() != out_dtype)
    for (auto& t : m.out_stage) t = at::empty({m.chunk}, t.options().dtype(out_dtype));

  // Two copy streams (one per direction, so both copy engines run), ordered after the caller's
  // stream (the work that wrote the gradients); the caller's stream waits for the last copy back.
  const c10::impl::VirtualGuardImpl guard(m.device.type());
  const c10::Stream caller = guard.getStream(m.device);
  const c10::Stream down = guard.getStreamFromGlobalPool(m.device, /*isHighPriority=*/false);
  const c10::Stream up = guard.getStreamFromGlobalPool(m.device, /*isHighPriority=*/false);
  {
    c10::Event ready(m.device.type());
    ready.record(caller);
    ready.block(down);
    ready.block(up);  // the compute shards are not rewritten while the caller's kernels may read them
  }
  std::vector<std::optional<c10::Event>> in_done(kSlots), out_done(kSlots);
  auto copy_in = [&](size_t c) {
    const Chunk& ch = chunks[c];
    const int k = static_cast<int>(c % kSlots);
    {
      c10::StreamGuard on(down);
      m.grad_stage[k].narrow(0, 0, ch.n).copy_(grads[ch.shard].narrow(0, ch.begin, ch.n), /*non_blocking=*/true);
    }
    in_done[k].emplace(m.device.type());
    in_done[k]->record(down);
  };
  for (size_t c = 0; c < chunks.size() && c < static_cast<size_t>(kSlots); ++c) copy_in(c);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const Chunk& ch = chunks[c];
    const int k = static_cast<int>(c % kSlots);
    const auto w0 = Clock::now();
    in_done[k]->synchronize();
    if (out_done[k]) out_done[k]->synchronize();  // the slot's previous chunk has left
    m.timing.copy_wait_s += since(w0);
    const auto u0 = Clock::now();
    m.update(ch.shard, ch.begin, ch.n, m.grad_stage[k].data_ptr<float>(), m.out_stage[k].data_ptr(), kind, decayed,
             plain);
    m.timing.update_s += since(u0);
    {
      c10::StreamGuard on(up);
      compute[ch.shard].narrow(0, ch.begin, ch.n).copy_(m.out_stage[k].narrow(0, 0, ch.n), /*non_blocking=*/true);
    }
    out_done[k].emplace(m.device.type());
    out_done[k]->record(up);
    if (c + kSlots < chunks.size()) copy_in(c + kSlots);  // the slot's gradient buffer is free again
  }
  c10::Event finished(m.device.type());
  finished.record(up);
  finished.block(caller);
  // The staging buffers are reused by the next step: its first copies wait for this one's last.
  finished.synchronize();
  m.timing.total_s = since(t0);
}

int64_t HostAdamW::steps() const { return impl_->steps; }
void HostAdamW::set_steps(int64_t steps) { impl_->steps = steps; }
size_t HostAdamW::size() const { return impl_->shards.size(); }
int HostAdamW::threads() const { return impl_->pool.size(); }
const at::Tensor& HostAdamW::master(size_t i) const { return impl_->shards.at(i).master; }
const at::Tensor& HostAdamW::exp_avg(size_t i) const { return impl_->shards.at(i).exp_avg; }
const at::Tensor& HostAdamW::exp_avg_sq(size_t i) const { return impl_->shards.at(i).exp_avg_sq; }
HostAdamW::Timing HostAdamW::last_timing() const { return impl_->timing; }

void HostAdamW::load_state(size_t i, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
  Impl::Shard& s = impl_->shards.at(i);
  TILLER_CHECK(exp_avg.numel() == s.master.numel() && exp_avg_sq.numel() == s.master.numel(),
               "optimizer state of {} elements for a shard of {}", exp_avg.numel(), s.master.numel());
  s.exp_avg.copy_(exp_avg.reshape({-1}));
  s.exp_avg_sq.copy_(exp_avg_sq.reshape({-1}));
}

int64_t HostAdamW::host_bytes() const {
  const Impl& m = *impl_;
  int64_t b = 0;
  for (const auto& s : m.shards) b += 3 * s.master.numel() * static_cast<int64_t>(sizeof(float));
  for (const auto& t : m.grad_stage) b += t.numel() * t.element_size();
  for (const auto& t : m.out_stage) b += t.numel() * t.element_size();
  return b;
}

}  // namespace tiller::zero
