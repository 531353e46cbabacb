// Sequence parallelism: S ranks of a role share each packed micro-batch, each holding 1/S of its
// tokens (roles.<r>.sequence_parallel; docs/zero.md says why Ulysses).
//
// The split. A packed row of T tokens (whole sequences back to back) is cut into S contiguous
// slices of c = ceil(T / S) rows: rank j of the sequence group holds rows [j c, min(T, (j+1) c)).
// A slice may start or end inside a sequence, and the last slices may be short or empty (T < S);
// every rank computes on c rows, the missing ones padded. The controller cuts the row (the
// SequenceSplit rule here is the one both sides use), so a rank receives only its own rows.
//
// The compute. Everything in a transformer but attention works row by row, so each rank runs the
// embedding, the projections, the MLPs, the norms and the heads on its own rows only. Attention
// (Ulysses): one all-to-all turns [c rows, all heads] into [S c rows, H / S heads], each rank runs
// ordinary varlen attention over the whole row for its heads (GQA, sliding windows and mixed
// lengths need nothing special), and a second all-to-all turns the result back. The all-to-all is
// its own inverse, so the backward is two more of them, and log-probs, entropies, values, losses
// and gradients are those of S = 1: per-row losses summed over the group's ranks are the S = 1 sum,
// and ZeRO-3's reduce-scatter over the role's ranks adds up the gradients as before.
//
// Heads: S must divide the attention heads. KV heads are split when S divides them; when they are
// fewer, S must be a multiple of their count and each rank gets (a copy of) the one KV head its
// query heads use; backward sums the copies' gradients.
//
// Context parallelism (roles.<r>.context_parallel: R, dividing S): the S ranks form R groups of
// U = S / R consecutive ranks. Within a group, Ulysses as above over U ranks (U divides the heads),
// which leaves each rank the group's U c rows for H / U heads; then the R ranks that hold the same
// heads (one per group) all-gather their keys and values, and each attends its U c query rows
// over the keys of the row up to its last query: for every sequence its rows seen so far, with the
// causal mask aligned to the queries' ends (model::varlen_attention's Lq < Lk form). No head limit
// beyond U's, any window, and the backward is autograd's: the all-gather's is a reduce-scatter of
// the keys' and values' gradients. R = S: no head exchange at all. K/V are small next to q under
// GQA (Qwen2-7B: 4 of 28 heads), which is why an all-gather rather than a ring (Llama 3's choice).
//
// Collective contract: every rank of the sequence group calls each forward and backward with its
// own slice of the same row (same seq_lens), in the same order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/model_config.h"
#include "tiller/model/transformer.h"

namespace tiller::dist {
class Communicator;
}

namespace tiller::zero {

// Which rows of a packed row of `rows` tokens rank j of `parts` holds.
struct SequenceSplit {
  int64_t rows = 0;
  int parts = 1;
  int64_t chunk() const { return std::max<int64_t>(1, (rows + parts - 1) / parts); }  // rows each rank computes
  int64_t begin(int j) const { return std::min(rows, j * chunk()); }
  int64_t size(int j) const { return std::min(rows, begin(j) + chunk()) - begin(j); }
};

// One rank's rows of a packed micro-batch.
struct SequenceSlice {
  at::Tensor tokens;               // int64 [n]: rows [first_row, first_row + n) of the packed row
  int64_t first_row = 0;
  std::vector<int64_t> seq_lens;   // every sequence of the packed row (positions restart at 0 in each)
  // Routing replay (model::BlockContext::replay_routes): int16 [n, sparse layers, k] on the host
  // for the same rows as `tokens`, or undefined (the router routes).
  at::Tensor routes;

  int64_t rows() const;  // T: the sum of seq_lens
  // Rank j of `parts`' slice of `whole` (tests and benchmarks; the controller cuts its own).
  static SequenceSlice of(const model::PackedBatch& whole, int parts, int j);
};

// ConfigError naming `key` unless a model with `cfg`'s heads can run sequence-parallel over `s`
// ranks (s >= 1) of which `context_parallel` groups split the keys (dividing s): the heads split
// s / context_parallel ways.
void check_sequence_parallel(const model::ModelConfig& cfg, int s, const std::string& key, int context_parallel = 1);

// The communicators of one rank's sequence group: `whole` (all S ranks; rows are cut over them),
// and for context parallelism R > 1 `heads` (the U = S / R consecutive ranks of its Ulysses group;
// null when U = 1) and `keys` (the R ranks holding the same heads, one per Ulysses group, in row
// order). R = 1: heads is whole (Ulysses over all S), keys null.
struct SequenceGroups {
  dist::Communicator* whole = nullptr;
  dist::Communicator* heads = nullptr;
  dist::Communicator* keys = nullptr;
  int size() const;
  bool parallel() const { return size() > 1; }
};

// What a forward over a slice needs: the rank's c rows of tokens (padded), the block context whose
// attention covers the whole row (through the group when it has more than one rank), and how many
// of the c rows are real. `group` may be null for S = 1 (then the slice must be the whole row).
struct SliceInput {
  at::Tensor tokens;  // int64 [c] on the device
  model::BlockContext ctx;
  int64_t rows = 0;   // real rows: outputs are narrowed to them
  int64_t padded = 0;  // c
};
SliceInput prepare_slice(const model::Rope& rope, const SequenceSlice& slice, const SequenceGroups& groups,
                         at::ScalarType dtype, at::Device device, model::AttentionBackend backend);

// Ulysses attention of this rank's rows: q [c, H, d], k and v [c, Hk, d] -> [c, H, d], over the
// whole row that `spec` describes (S c rows). Differentiable. Collective over `group`.
at::Tensor ulysses_attention(dist::Communicator& group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const model::VarlenSpec& spec, double scale, model::AttentionBackend backend);

// Sets ctx's attention to the sequence group's (which must outlive ctx's use): Ulysses over
// groups.heads, then with groups.keys the all-gathered keys, for the packed row ctx.attn describes
// (the whole row's self spec, S c rows). No-op for S = 1.
void use_sequence_groups(model::BlockContext& ctx, const SequenceGroups& groups);

// out = the all-to-all of x over `group` (communicator.h): x's first dimension is the group's
// size. Differentiable (its backward is the same exchange). Collective.
at::Tensor all_to_all(dist::Communicator& group, const at::Tensor& x);

}  // namespace tiller::zero
