// The functional decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral).
//
// Functions, not modules: each takes the config, the weights it needs (views owned elsewhere,
// see weights.h) and a packed batch, and returns tensors. All run under autograd when the
// weights require grad. Compute happens in the weights' dtype; norms, softmax and RoPE tables in
// fp32, as Hugging Face does.
//
// A packed batch is B sequences concatenated into one token row (no padding): cu_seqlens marks
// the boundaries, positions restart at 0 for each sequence (or continue after a cache).
//
// Callers that own block-level storage (the ZeRO-3 trainer) drive the pieces themselves:
//   ctx = make_block_context(cfg, rope, batch, dtype);
//   x = embed(w.embed, batch.tokens);
//   for i: x = block_forward(cfg, i, w.layers[i], x, ctx);
//   h = final_norm(cfg, w.final_norm, x);   // then token_logprobs(h, ...) or values(h, ...)
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/model/attention.h"
#include "tiller/model/model_config.h"
#include "tiller/model/weights.h"

namespace tiller::model {

struct PackedBatch {
  at::Tensor tokens;      // int64 [T]
  at::Tensor positions;   // int64 [T]
  at::Tensor cu_seqlens;  // int32 [B+1]
  std::vector<int64_t> seq_lens;
  at::Tensor routes;      // optional: replayed experts, int16 [T, sparse layers, k] (BlockContext)

  int64_t num_tokens() const { return tokens.defined() ? tokens.size(0) : 0; }
  int64_t num_seqs() const { return static_cast<int64_t>(seq_lens.size()); }
  // Packs token lists; positions start at `start_positions[i]` (default 0) for sequence i.
  static PackedBatch pack(const std::vector<std::vector<int64_t>>& seqs, at::Device device,
                          const std::vector<int64_t>& start_positions = {});
};

// RoPE frequencies for a config (default, linear, dynamic NTK, llama3 and yarn scaling, computed
// the way transformers computes them).
class Rope {
 public:
  explicit Rope(const ModelConfig& cfg);
  // cos and sin tables [T, head_dim] for `positions`, in `dtype`, on positions' device.
  // `seq_lens` (the packing) matters only to dynamic NTK scaling, which is applied per sequence.
  std::pair<at::Tensor, at::Tensor> tables(const at::Tensor& positions, at::ScalarType dtype,
                                           const std::vector<int64_t>& seq_lens = {}) const;
  const at::Tensor& inv_freq() const { return inv_freq_; }  // [head_dim / 2], fp32, CPU
  // Whether a row's table depends on its whole sequence (dynamic NTK), not on its position alone.
  bool per_sequence() const { return cfg_.rope_scaling.type == "dynamic"; }
  double attention_scaling() const { return attention_scaling_; }

 private:
  ModelConfig cfg_;
  at::Tensor inv_freq_;
  double attention_scaling_ = 1.0;
};

// Where a block's attention finds the keys and values of earlier tokens. Implemented by the
// reference generator's DenseKvCache and by the engine's paged cache.
class KvCache {
 public:
  virtual ~KvCache() = default;
  // Stores this step's k and v [T, kv_heads, head_dim] of `layer` (packed as spec.lens_q says)
  // and returns the causal attention of q [T, heads, head_dim] over each sequence's cached
  // tokens followed by the new ones: [T, heads, head_dim]. `spec` carries the query layout and
  // the key lengths (cached + new) that the BlockContext was made with.
  virtual at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const VarlenSpec& spec, double scale, AttentionBackend backend) = 0;
  // True when attend() takes q and k before RoPE and rotates them itself, with the tables of the
  // step it was made for (the engine's decode kernel: no RoPE launch of its own).
  virtual bool applies_rope() const { return false; }
};

// Contiguous per-sequence K/V of every layer: the cache of the reference generator (the engine
// has its own paged cache). k[layer][seq] is [len, kv_heads, head_dim].
class DenseKvCache : public KvCache {
 public:
  DenseKvCache(int64_t layers, int64_t seqs);
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const VarlenSpec& spec, double scale, AttentionBackend backend) override;

  std::vector<std::vector<at::Tensor>> k, v;
  std::vector<int64_t> lens;  // cached tokens per sequence
};

// A mixture of experts' router losses over one sparse layer's counted rows (T of them; probs the
// router's softmax in fp32, [T, E]; f_e the share of the T * k routes that went to expert e):
//   aux = E * sum_e f_e * mean_t probs[t, e]   (load balancing: transformers' formula, per layer;
//                                               k when the load is even, up to E * k when not)
//   z   = mean_t logsumexp(logits[t])^2       (ST-MoE's z-loss: keeps the router's logits small)
// Each sparse layer sets `layer` to aux_coef * aux + z_coef * z (differentiable through the router
// and its input; the routes themselves are not) and adds its aux and z (detached, fp32 scalars on
// the device) to `aux_sum` and `z_sum`. A layer with no counted rows sets `layer` to a zero.
struct RouterLoss {
  double aux_coef = 0;
  double z_coef = 0;
  at::Tensor layer;
  at::Tensor aux_sum, z_sum;
};

// What every block of one forward shares: RoPE tables, the attention layout, the cache.
struct BlockContext {
  at::Tensor cos, sin;  // [T, head_dim]
  VarlenSpec attn;
  AttentionBackend backend = AttentionBackend::kAuto;
  KvCache* cache = nullptr;  // when set, new K/V go into it and attention covers it
  // Sequence parallelism (zero/sequence_parallel.h): q, k, v hold this rank's rows only, and this
  // returns the attention of those rows over the whole packed row that `attn` describes. Unset:
  // varlen_attention. Not with a cache.
  std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenSpec& spec,
                           double scale, AttentionBackend backend)>
      attention;
  // Tensor parallelism: o_proj and down_proj then hold a slice of their input features, so their
  // outputs are partial sums that this sums over the group, in place, before the residual add.
  std::function<void(at::Tensor&)> reduce_partial_sums;
  // Inference only (no autograd): each residual add is fused with the RMSNorm that follows it
  // (add_rms_norm). block_forward then updates its input x in place (the residual stream) and
  // returns it without the MLP's output, which it leaves in `deferred` for the next block's input
  // norm; after the last block, add_deferred() or add_rms_norm(x, deferred, final norm) adds it.
  bool fuse_residual = false;
  at::Tensor deferred;
  // With fuse_residual, a layer whose four projections are tensor-scaled FP8 (the engine's
  // engines.fp8_scaling: tensor) runs them as fused FP8 GEMMs: the norms and SwiGLU quantize
  // their outputs, and the kernels that read a GEMM's output apply its rows' scales
  // (model/fp8_rows.h); `deferred` is then the down projection's product before its rows'
  // scales, `deferred_scale` (fp32 [>= T]) those scales. Off: the same numerics, one FP8 linear
  // at a time (for comparisons).
  bool fp8_fused = true;
  at::Tensor deferred_scale;
  // Mixture-of-experts routing (routing replay, docs/training.md). `replay_routes`, when defined:
  // int16 [T, sparse layers, k] on the host, row t's experts in each sparse layer (layer order),
  // taken instead of the router's top-k; the router's probabilities at those experts still weight
  // them (renormalised as the model's norm_topk_prob says), so the router trains. A row whose first
  // expert is -1 routes by itself (a token the engine never computed). `recorded_routes`, when set,
  // gets each sparse layer's experts [T, k] (int64; on the host from the loop, on the forward's
  // device from grouped_experts()) at that layer's index (sized to the model's layers; a
  // recomputed block overwrites its entry).
  at::Tensor replay_routes;
  std::vector<at::Tensor>* recorded_routes = nullptr;
  // Expert-load metrics: when set, each sparse layer adds the tokens routed to each of its experts
  // (double [sparse layers, experts], created at the first sparse layer: on the host from the
  // loop, on the forward's device from grouped_experts()) over the first `routed_rows` rows.
  at::Tensor* expert_load = nullptr;
  // Router losses (the trainer's training forward): when set, each sparse layer computes them over
  // the first `routed_rows` rows (RouterLoss).
  RouterLoss* router_loss = nullptr;
  // The rows the expert load and the router losses count: -1 every row; a sequence-parallel
  // slice's padding rows do not count.
  int64_t routed_rows = -1;
  // LoRA adapters (LayerWeights::lora, model/lora.h). `lora_off`: the base weights alone (a LoRA
  // actor's reference). lora_dropout > 0 (training) drops the adapters' inputs as PEFT does, by a
  // mask that a hash of (lora_dropout_seed, layer, projection, lora_first_row + row, column)
  // decides, so that a recomputed block and a sequence-parallel slice draw the same mask.
  bool lora_off = false;
  double lora_dropout = 0;
  int64_t lora_dropout_seed = 0;
  int64_t lora_first_row = 0;
  // FP8 training (roles.<role>.fp8): the attention's and the dense MLP's projections (a sparse
  // layer's shared expert too; not the router, the adapters or the routed experts) through
  // fp8::train_linear in this scaling. Unset: in the weights' dtype.
  std::optional<fp8::Scaling> fp8_training;
  // The forward GEMMs' fast accumulation (roles.<role>.fp8_fast_accumulation; fp8::train_linear).
  bool fp8_fast_accumulation = false;
};
BlockContext make_block_context(const ModelConfig& cfg, const Rope& rope, const PackedBatch& batch,
                                at::ScalarType dtype, DenseKvCache* cache = nullptr,
                                AttentionBackend backend = AttentionBackend::kAuto);

// x * cos + rotate_half(x) * sin for x [T, heads, head_dim] and tables [T, head_dim], as one
// autograd node (one fused kernel each way on CUDA).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// x += add in place, then rms_norm(x): one kernel on CUDA. Inference only (no autograd node).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& add, const at::Tensor& weight, double eps);
// The residual stream after the last block of a fuse_residual forward: x += ctx.deferred.
void add_deferred(at::Tensor& x, BlockContext& ctx);
// ctx.deferred with its rows' scales applied (deferred_scale), taken out of ctx (both left
// undefined): the addend of the next norm.
at::Tensor take_deferred(BlockContext& ctx);
// silu(gate) * up as one autograd node (its backward: two fused elementwise kernels).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
// silu(gate) * up from the fused gate/up projection's output [T, 2 I] (gate first): [T, I]. One
// kernel on CUDA; inference only (no autograd node).
at::Tensor swiglu_packed(const at::Tensor& gate_up);
at::Tensor embed(const at::Tensor& embedding, const at::Tensor& tokens);
// One transformer block: x [T, hidden] -> [T, hidden]. Head counts and the MLP width come from
// `cfg`; a tensor-parallel rank passes a config with its local counts (see reduce_partial_sums).
at::Tensor block_forward(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& x,
                         BlockContext& ctx);
// The block's two halves (without fuse_residual): block_forward(x) =
// mlp_residual(attention_residual(x)), where attention_residual(x) = x + o_proj(attention(norm(x)))
// and mlp_residual(y) = y + down_proj(swiglu(norm(y))). The trainer checkpoints them separately
// (zero::Recompute::kAttentionOnly).
at::Tensor attention_residual(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& x,
                              BlockContext& ctx);
at::Tensor mlp_residual(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& y,
                        BlockContext& ctx);
// Whether a mixture of experts of this (rank-local) config runs its experts as grouped GEMMs on
// tensors of this dtype and device (numerics.h: ExpertKernels): the routes then stay on the
// device and a CUDA graph can capture the layer. False for a dense model.
bool grouped_experts(const ModelConfig& cfg, at::ScalarType dtype, const at::Device& device);
// The number of sparse (mixture-of-experts) layers before `layer`: its index in
// BlockContext::replay_routes' second dimension.
int64_t sparse_index(const ModelConfig& cfg, int64_t layer);
int64_t sparse_layers(const ModelConfig& cfg);
at::Tensor final_norm(const ModelConfig& cfg, const at::Tensor& weight, const at::Tensor& x);

// Embedding, every block and the final norm: [T, hidden]. `fp8_training`, `fp8_fast_accumulation`:
// the blocks' GEMMs as BlockContext's fields of those names say (the fast forward by default, as
// roles.<r>.fp8_fast_accumulation's default).
at::Tensor forward_hidden(const ModelConfig& cfg, const ModelWeights& w, const PackedBatch& batch,
                          DenseKvCache* cache = nullptr, AttentionBackend backend = AttentionBackend::kAuto,
                          std::optional<fp8::Scaling> fp8_training = std::nullopt, bool fp8_fast_accumulation = true);

// Full logits [T, vocab] in fp32. Only for short inputs and tests: prefer token_logprobs.
at::Tensor logits(const at::Tensor& hidden, const at::Tensor& lm_head);
// The sampler's logits [T, vocab], in the weights' dtype (the engine's head; numerics.h's kernel
// under Numerics::kBatchInvariant, the one token_logprobs uses then).
at::Tensor lm_logits(const at::Tensor& hidden, const at::Tensor& lm_head);

// log softmax(hidden @ lm_head^T / temperature)[t, targets[t]] for every row t, [T] in fp32
// (fp64 for fp64 inputs).
// Computed `chunk_rows` rows at a time in forward and again in backward (a custom autograd
// function), so at most chunk_rows x vocab fp32 logits exist at once. When `entropy` is given it
// receives the entropy of each row's distribution, differentiable too (the entropy bonus): a loss
// may use either or both, and the backward handles both in the same chunked pass.
at::Tensor token_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& targets,
                          double temperature = 1.0, int64_t chunk_rows = 1024, at::Tensor* entropy = nullptr);

// The backward of token_logprobs outside autograd: from d loss / d logprobs ([T]) to
// (d hidden, d lm_head), recomputing the logits chunk by chunk. For callers that recompute the
// head themselves (the ZeRO-3 trainer); a gradient not asked for is undefined. The weight
// gradient accumulates over chunks in fp32 and is returned in the weight's dtype, or in fp32 with
// `fp32_weight_grad`. `grad_entropy` (d loss / d entropy, [T]) adds the entropies' gradient;
// either gradient may be undefined (zero). `weight_grad_into`, when defined (fp32, or fp64 for
// fp64 inputs; the weight's shape, contiguous), receives the weight gradient added to what it
// holds, and is returned: a caller's buffer instead of a second [vocab, hidden] tensor.
std::pair<at::Tensor, at::Tensor> token_logprobs_backward(const at::Tensor& hidden, const at::Tensor& lm_head,
                                                          const at::Tensor& targets, const at::Tensor& grad,
                                                          double temperature = 1.0, int64_t chunk_rows = 1024,
                                                          bool need_hidden = true, bool need_weight = true,
                                                          bool fp32_weight_grad = false,
                                                          const at::Tensor& grad_entropy = at::Tensor(),
                                                          const at::Tensor& weight_grad_into = at::Tensor());

// Scalar value per row from the `score` head, fp32 [T].
at::Tensor values(const at::Tensor& hidden, const at::Tensor& score);

}  // namespace tiller::model
