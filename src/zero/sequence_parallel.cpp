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

void check_sequence_parallel(const model::ModelConfig& cfg, int s, const std::string& key) {
  if (s < 1) throw ConfigError(fmt::format("{} = {}: must be at least 1", key, s));
  if (s == 1) return;
  if (cfg.num_heads % s != 0)
    throw ConfigError(fmt::format("{} = {}: the model has {} attention heads, which {} ranks cannot split evenly "
                                  "(Ulysses gives each rank heads / S); use a divisor of {}",
                                  key, s, cfg.num_heads, s, cfg.num_heads));
  if (cfg.num_kv_heads % s != 0 && s % cfg.num_kv_heads != 0)
    throw ConfigError(fmt::format("{} = {}: the model has {} KV heads; S must divide them or be a multiple of them",
                                  key, s, cfg.num_kv_heads));
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

}  // namespace

at::Tensor all_to_all(dist::Communicator& group, const at::Tensor& x) {
  TILLER_CHECK(x.dim() >= 1 && x.size(0) == group.size(), "all_to_all: the first dimension ({}) must be the group's "
               "size ({})", x.dim() ? x.size(0) : 0, group.size());
  return AllToAll::apply(x, &group);
}

at::Tensor ulysses_attention(dist::Communicator& group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const model::VarlenSpec& spec, double scale, model::AttentionBackend backend) {
  const int s = group.size();
  const int64_t c = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TILLER_CHECK(heads % s == 0 && (kv_heads % s == 0 || s % kv_heads == 0),
               "sequence parallel over {} ranks with {} heads and {} KV heads", s, heads, kv_heads);
  const int64_t hq = heads / s, hk = kv_heads % s == 0 ? kv_heads / s : 1;
  // [c, S, hq + 2 hk, d]: rank g's heads side by side, then rank-major for the exchange.
  at::Tensor send = at::cat({q.reshape({c, s, hq, d}), kv_heads_by_rank(k, s), kv_heads_by_rank(v, s)}, 2).transpose(0, 1);
  // [S (source rank), c, hq + 2 hk, d] = the whole row's rows, in order, for this rank's heads.
  at::Tensor recv = all_to_all(group, send).view({s * c, hq + 2 * hk, d});
  at::Tensor out = model::varlen_attention(recv.narrow(1, 0, hq), recv.narrow(1, hq, hk), recv.narrow(1, hq + hk, hk),
                                           spec, scale, backend);  // [S c, hq, d]
  // Rows i c .. (i+1) c back to rank i: [S (head group), c, hq, d] -> [c, H, d].
  return all_to_all(group, out.view({s, c, hq, d})).transpose(0, 1).reshape({c, heads, d});
}

void use_ulysses(model::BlockContext& ctx, dist::Communicator& group) {
  ctx.attention = [g = &group](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const model::VarlenSpec& spec, double scale, model::AttentionBackend b) {
    return ulysses_attention(*g, q, k, v, spec, scale, b);
  };
}

SliceInput prepare_slice(const model::Rope& rope, const SequenceSlice& slice,
                         dist::Communicator* group, at::ScalarType dtype, at::Device device,
                         model::AttentionBackend backend) {
  const int s = group ? group->size() : 1;
  const int j = group ? group->rank() : 0;
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
  if (s > 1) use_ulysses(in.ctx, *group);
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
