#include "tiller/zero/sequence_parallel.h"

#include <algorithm>
#include <numeric>

#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "model/host_upload.h"
#include "tiller/core/error.h"
#include "tiller/dist/communicator.h"

namespace tiller::zero {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t SequenceSlice::rows() const { return std::accumulate(seq_lens.begin(), seq_lens.end(), int64_t{0}); }

SequenceSlice SequenceSlice::of(const model::PackedBatch& whole, int parts, int j) {
  const SequenceSplit split{whole.num_tokens(), parts};
  SequenceSlice s;
  s.first_row = split.begin(j);
  s.tokens = whole.tokens.narrow(0, s.first_row, split.size(j));
  s.seq_lens = whole.seq_lens;
  if (whole.routes.defined()) s.routes = whole.routes.narrow(0, s.first_row, split.size(j)).contiguous();
  return s;
}

int SequenceGroups::size() const { return whole ? whole->size() : 1; }

void check_sequence_parallel(const model::ModelConfig& cfg, int s, const std::string& key, int context_parallel) {
  if (s < 1) throw ConfigError(fmt::format("{} = {}: must be at least 1", key, s));
  if (context_parallel < 1 || s % context_parallel != 0)
    throw ConfigError(fmt::format("{} = {} with context_parallel = {}: context_parallel must divide it", key, s,
                                  context_parallel));
  const int u = s / context_parallel;  // the ranks of each Ulysses group, which split the heads
  if (u == 1) return;
  const std::string who = context_parallel == 1
                              ? fmt::format("{} = {}", key, s)
                              : fmt::format("{} = {} with context_parallel = {} (heads split {} ways)", key, s,
                                            context_parallel, u);
  if (cfg.num_heads % u != 0)
    throw ConfigError(fmt::format("{}: the model has {} attention heads, which {} ranks cannot split evenly (Ulysses "
                                  "gives each rank heads / {}); use a divisor of {}, or a larger context_parallel "
                                  "(which all-gathers keys instead of splitting heads)",
                                  who, cfg.num_heads, u, u, cfg.num_heads));
  if (cfg.num_kv_heads % u != 0 && u % cfg.num_kv_heads != 0)
    throw ConfigError(fmt::format("{}: the model has {} KV heads; the {} ranks splitting heads must divide them or be "
                                  "a multiple of them",
                                  who, cfg.num_kv_heads, u));
}

namespace {

at::Tensor exchange(dist::Communicator& group, const at::Tensor& x) {
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  group.all_to_all(in, out)->wait_on_stream();
  return out;
}

struct AllToAll : public torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, dist::Communicator* group) {
    ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(group));
    return exchange(*group, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<dist::Communicator*>(static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
    return {exchange(*group, grads[0]), at::Tensor()};
  }
};

// x [c, kv_heads, d] as [c, S, per_rank, d]: the KV heads that rank g's query heads use, at [:, g].
// Split when S divides the KV heads; else each KV head serves S / kv_heads consecutive ranks, so
// it is repeated that many times (the backward of the repeat sums the copies' gradients).
at::Tensor kv_heads_by_rank(const at::Tensor& x, int s) {
  const int64_t c = x.size(0), kv_heads = x.size(1), d = x.size(2);
  if (kv_heads % s == 0) return x.reshape({c, s, kv_heads / s, d});
  return x.repeat_interleave(s / kv_heads, 1).view({c, s, 1, d});
}

// out [R n, ...] = every rank's x [n, ...] in rank order; the backward reduce-scatters the
// gradient (each rank's copy of the rows contributes to them).
struct AllGatherRows : public torch::autograd::Function<AllGatherRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, dist::Communicator* group) {
    ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(group));
    const at::Tensor in = x.contiguous();
    std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
    shape[0] *= group->size();
    at::Tensor out = at::empty(shape, in.options());
    group->all_gather(in, out)->wait_on_stream();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<dist::Communicator*>(static_cast<intptr_t>(ctx->saved_data["group"].toInt()));
    const at::Tensor g = grads[0].contiguous();
    std::vector<int64_t> shape(g.sizes().begin(), g.sizes().end());
    shape[0] /= group->size();
    at::Tensor out = at::empty(shape, g.options());
    group->reduce_scatter(g, out, dist::ReduceOp::kSum)->wait_on_stream();
    return {out, at::Tensor()};
  }
};

// Ulysses' first exchange: this rank's c rows of every head -> the group's S c rows of its heads,
// as [S c, hq + 2 hk, d] (q, then k, then v heads).
at::Tensor rows_for_heads(dist::Communicator& group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          int64_t& hq, int64_t& hk) {
  const int s = group.size();
  const int64_t c = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TILLER_CHECK(heads % s == 0 && (kv_heads % s == 0 || s % kv_heads == 0),
               "sequence parallel over {} ranks with {} heads and {} KV heads", s, heads, kv_heads);
  hq = heads / s;
  hk = kv_heads % s == 0 ? kv_heads / s : 1;
  // [c, S, hq + 2 hk, d]: rank g's heads side by side, then rank-major for the exchange.
  at::Tensor send = at::cat({q.reshape({c, s, hq, d}), kv_heads_by_rank(k, s), kv_heads_by_rank(v, s)}, 2).transpose(0, 1);
  // [S (source rank), c, hq + 2 hk, d] = the whole row's rows, in order, for this rank's heads.
  return all_to_all(group, send).view({s * c, hq + 2 * hk, d});
}

// The second exchange: out [S c, hq, d] -> this rank's c rows of every head [c, S hq, d].
at::Tensor heads_for_rows(dist::Communicator& group, const at::Tensor& out) {
  const int s = group.size();
  const int64_t c = out.size(0) / s, hq = out.size(1), d = out.size(2);
  // Rows i c .. (i+1) c back to rank i: [S (head group), c, hq, d] -> [c, H, d].
  return all_to_all(group, out.view({s, c, hq, d})).transpose(0, 1).reshape({c, s * hq, d});
}

// Context parallelism: this rank's query rows [a, b) of the packed row and the keys they see.
struct KeyPlan {
  int64_t key_first = 0, key_rows = 0;  // the keys: rows [key_first, key_first + key_rows) of the row
  model::VarlenSpec spec;               // the queries' sequences over those keys (Lq <= Lk, end-aligned)
};

KeyPlan plan_keys(const std::vector<int64_t>& lens, int64_t a, int64_t b, at::Device device) {
  KeyPlan p;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t start = 0;
  bool first = true;
  for (int64_t len : lens) {
    const int64_t end = start + len;
    if (len > 0 && end > a && start < b) {
      if (first) p.key_first = start;
      first = false;
      const int64_t lq = std::min(end, b) - std::max(start, a), lk = std::min(end, b) - start;
      p.spec.lens_q.push_back(lq);
      p.spec.lens_k.push_back(lk);
      p.spec.max_q = std::max(p.spec.max_q, lq);
      p.spec.max_k = std::max(p.spec.max_k, lk);
      cu_q.push_back(static_cast<int32_t>(cu_q.back() + lq));
      cu_k.push_back(static_cast<int32_t>(cu_k.back() + lk));
    }
    start = end;
  }
  TILLER_CHECK(!first && cu_q.back() == b - a, "context parallel: rows [{}, {}) of a row of {} are not covered by its "
               "sequences", a, b, start);
  p.key_rows = b - p.key_first;
  p.spec.cu_q = model::upload(cu_q, device);
  p.spec.cu_k = model::upload(cu_k, device);
  return p;
}

}  // namespace

at::Tensor all_to_all(dist::Communicator& group, const at::Tensor& x) {
  TILLER_CHECK(x.dim() >= 1 && x.size(0) == group.size(), "all_to_all: the first dimension ({}) must be the group's "
               "size ({})", x.dim() ? x.size(0) : 0, group.size());
  return AllToAll::apply(x, &group);
}

at::Tensor ulysses_attention(dist::Communicator& group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const model::VarlenSpec& spec, double scale, model::AttentionBackend backend) {
  int64_t hq = 0, hk = 0;
  const at::Tensor recv = rows_for_heads(group, q, k, v, hq, hk);
  const at::Tensor out = model::varlen_attention(recv.narrow(1, 0, hq), recv.narrow(1, hq, hk),
                                                 recv.narrow(1, hq + hk, hk), spec, scale, backend);  // [S c, hq, d]
  return heads_for_rows(group, out);
}

void use_sequence_groups(model::BlockContext& ctx, const SequenceGroups& groups) {
  if (!groups.parallel()) return;
  if (!groups.keys) {  // Ulysses over the whole group
    ctx.attention = [g = groups.heads](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const model::VarlenSpec& spec, double scale, model::AttentionBackend b) {
      return ulysses_attention(*g, q, k, v, spec, scale, b);
    };
    return;
  }
  // This rank's queries after the head exchange: its Ulysses group's U c rows.
  const int64_t total = std::accumulate(ctx.attn.lens_q.begin(), ctx.attn.lens_q.end(), int64_t{0});
  const int64_t span = total / groups.keys->size();  // U c
  TILLER_CHECK(span * groups.keys->size() == total, "context parallel: a row of {} rows over {} groups", total,
               groups.keys->size());
  const int64_t a = groups.keys->rank() * span;
  const at::Device device = ctx.attn.cu_q.defined() ? ctx.attn.cu_q.device() : at::Device(at::kCPU);
  auto plan = std::make_shared<const KeyPlan>(plan_keys(ctx.attn.lens_q, a, a + span, device));
  ctx.attention = [groups, plan](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const model::VarlenSpec& spec, double scale, model::AttentionBackend b) {
    at::Tensor qh = q, kv;
    int64_t hk = k.size(1);
    if (groups.heads) {
      int64_t hq = 0;
      const at::Tensor recv = rows_for_heads(*groups.heads, q, k, v, hq, hk);
      qh = recv.narrow(1, 0, hq);
      kv = recv.narrow(1, hq, 2 * hk);
    } else {
      kv = at::cat({k, v}, 1);
    }
    // Every group's keys and values for these heads, in row order: [S c, 2 hk, d].
    const at::Tensor all = AllGatherRows::apply(kv, groups.keys).narrow(0, plan->key_first, plan->key_rows);
    model::VarlenSpec keyed = plan->spec;
    keyed.window = spec.window;
    const at::Tensor out = model::varlen_attention(qh, all.narrow(1, 0, hk), all.narrow(1, hk, hk), keyed, scale, b);
    return groups.heads ? heads_for_rows(*groups.heads, out) : out;
  };
}

SliceInput prepare_slice(const model::Rope& rope, const SequenceSlice& slice, const SequenceGroups& groups,
                         at::ScalarType dtype, at::Device device, model::AttentionBackend backend) {
  const int s = groups.size();
  const int j = groups.whole ? groups.whole->rank() : 0;
  const SequenceSplit split{slice.rows(), s};
  const int64_t n = slice.tokens.defined() ? slice.tokens.numel() : 0;
  TILLER_CHECK(slice.first_row == split.begin(j) && n == split.size(j),
               "sequence-parallel rank {} of {}: holds rows [{}, {}) of a row of {}, expected [{}, {})", j, s,
               slice.first_row, slice.first_row + n, split.rows, split.begin(j), split.begin(j) + split.size(j));
  SliceInput in;
  in.rows = n;
  in.padded = s == 1 ? n : split.chunk();
  // The whole row's positions and sequences, with the padding as one more sequence at the end.
  std::vector<int64_t> lens = slice.seq_lens;
  const int64_t pad = s * in.padded - split.rows;
  if (pad > 0) lens.push_back(pad);
  // RoPE tables for this rank's rows only, unless the scaling depends on each whole sequence
  // (dynamic NTK): then for the whole row, and this rank's rows of them.
  const bool whole_row = rope.per_sequence() && s > 1;
  const int64_t first = s == 1 ? 0 : j * in.padded;
  const int64_t from = whole_row ? 0 : first, to = whole_row ? s * in.padded : first + in.padded;
  std::vector<int64_t> positions;
  std::vector<int32_t> cu{0};
  positions.reserve(static_cast<size_t>(to - from));
  for (int64_t len : lens) {
    TILLER_CHECK(cu.back() + len < (int64_t{1} << 31), "a packed row holds at most 2^31 tokens");
    const int64_t start = cu.back();
    for (int64_t r = std::max(start, from); r < std::min(start + len, to); ++r) positions.push_back(r - start);
    cu.push_back(static_cast<int32_t>(start + len));
  }
  const at::Tensor pos = model::upload(positions, device);
  const at::Tensor cu_t = model::upload(cu, device);
  auto [cos, sin] = rope.tables(pos, dtype, whole_row || s == 1 ? lens : std::vector<int64_t>{});
  in.ctx.cos = whole_row ? cos.narrow(0, first, in.padded) : cos;
  in.ctx.sin = whole_row ? sin.narrow(0, first, in.padded) : sin;
  in.ctx.backend = backend;
  in.ctx.attn = model::VarlenSpec::self(cu_t, lens);
  use_sequence_groups(in.ctx, groups);
  at::Tensor tokens = n > 0 ? model::upload(slice.tokens, device, at::kLong)
                            : at::empty({0}, at::TensorOptions(at::kLong).device(device));
  if (in.padded > n) tokens = at::cat({tokens, at::zeros({in.padded - n}, tokens.options())});
  in.tokens = tokens;
  if (slice.routes.defined()) {
    const at::Tensor& r = slice.routes;
    TILLER_CHECK(r.dim() == 3 && r.size(0) == n && r.scalar_type() == at::kShort,
                 "routing replay: the slice's routes cover {} rows, its tokens {}", r.dim() == 3 ? r.size(0) : -1, n);
    at::Tensor routes = r.cpu().contiguous();
    if (in.padded > n)  // padding rows route by themselves
      routes = at::cat({routes, at::full({in.padded - n, r.size(1), r.size(2)}, -1, routes.options())});
    in.ctx.replay_routes = routes;
  }
  return in;
}

}  // namespace tiller::zero
