// The activation side of the memory plan (tiller/job/memory_plan.h): what a trained or scoring
// model keeps per token under each recompute mode, LoRA's share of it, and the order in which
// train.recompute = auto tries the modes.
#include "job/activation_memory.h"

#include <algorithm>
#include <utility>

#include "tiller/job/memory_plan.h"
#include "tiller/model/lora.h"

namespace tiller::job {
namespace {

// Rows of the LM head's fp32 logits chunk (zero::ShardedModelOptions::logprob_chunk_rows).
constexpr int64_t kLogitRows = 1024;

// Per token, the elements of the MLP's gate, up and product: a sparse layer runs experts_per_token
// experts (and the shared one) on it, each on a gathered copy of the token whose scaled output is
// kept too, beside the router's probabilities.
int64_t mlp_elements(const model::ModelConfig& c) {
  if (!c.moe()) return 3 * c.intermediate_size;
  return 3 * (c.experts_per_token * c.moe_intermediate_size + c.shared_expert_intermediate_size) +
         2 * c.experts_per_token * c.hidden_size + c.num_experts;
}

// One block's intermediate tensors per token (q/k/v, attention out, norms, the MLP's gate, up and
// product), twice over for what autograd keeps and the recomputation's temporaries.
int64_t block_internals_per_token(const model::ModelConfig& c, int64_t bytes) {
  return 2 * (4 * c.hidden_size + c.q_size() + 2 * c.kv_size() + mlp_elements(c)) * bytes;
}

// What LoRA adds per token to a kept block half (bytes): each adapted group's input (q/k/v and
// gate/up share theirs: cast once) in fp32 for the A gradients, in place of the copy the frozen
// base's projections no longer keep for their weight gradients; and each adapter's rank-r
// intermediate for its B gradient. {attention half, MLP half}.
std::pair<int64_t, int64_t> lora_activation_bytes(const model::ModelConfig& c, int64_t bytes, const model::LoraSpec& l) {
  auto on = [&](model::LoraModule m) { return l.targets[static_cast<size_t>(m)] ? 1 : 0; };
  using M = model::LoraModule;
  const int64_t f = 4 - bytes, r4 = 4 * l.rank;
  const int64_t qkv = on(M::kQ) + on(M::kK) + on(M::kV), gu = on(M::kGate) + on(M::kUp);
  const int64_t attention = (qkv > 0 ? f * c.hidden_size : 0) + on(M::kO) * f * c.q_size() + (qkv + on(M::kO)) * r4;
  const int64_t mlp = (gu > 0 ? f * c.hidden_size : 0) + on(M::kDown) * f * c.intermediate_size + (gu + on(M::kDown)) * r4;
  return {attention, mlp};
}

}  // namespace

int64_t train_activation_bytes(const model::ModelConfig& c, int64_t tokens, int64_t bytes, zero::Recompute mode,
                               int64_t layers, const model::LoraSpec* lora) {
  // What autograd keeps of one block per token (elements; zero/sharded_model.cpp's modes):
  // the block's input; the attention half's normed input, RoPE'd q and k, v and the attention
  // output (q and k twice more before RoPE with qk_norm); the MLP half's input, normed input,
  // gate, up and their product.
  const int64_t input = c.hidden_size;
  const int64_t attention = c.hidden_size + 2 * c.q_size() + 2 * c.kv_size() + (c.qk_norm ? c.q_size() + c.kv_size() : 0);
  const int64_t mlp = 2 * c.hidden_size + mlp_elements(c);
  int64_t extra = 0;
  if (mode == zero::Recompute::kAttentionOnly) extra = mlp;
  if (mode == zero::Recompute::kNone) extra = attention + mlp;
  const int64_t keeping = layers < 0 ? c.num_layers : std::min(layers, c.num_layers);
  // One block's backward in flight: what it recomputes (kBlocks, kAttentionOnly) and the
  // gradients of its activations.
  int64_t per_token = (c.num_layers * input + keeping * extra) * bytes + block_internals_per_token(c, bytes);
  if (lora && lora->enabled()) {
    const auto [la, lm] = lora_activation_bytes(c, bytes, *lora);
    if (mode == zero::Recompute::kAttentionOnly) per_token += keeping * lm;
    if (mode == zero::Recompute::kNone) per_token += keeping * (la + lm);
    per_token += 2 * (la + lm);  // the block in flight
  }
  // The LM head's chunk of logits: in fp32 with its softmax and gradient (3 copies); in bf16 the
  // fused kernel turns the logits into their gradient in place (one copy, and its temporaries).
  return tokens * per_token + kLogitRows * c.vocab_size * (bytes == 4 ? 12 : 2 * bytes);
}

int64_t score_activation_bytes(const model::ModelConfig& c, int64_t tokens, int64_t bytes) {
  return tokens * (block_internals_per_token(c, bytes) / 2 + 2 * c.hidden_size * bytes) + kLogitRows * c.vocab_size * 4 * 2;
}

namespace {
constexpr int64_t kAllLayers = int64_t{1} << 20;  // above any layer count (train.recompute_layers' bound)
}

double recompute_order(zero::Recompute mode, int64_t layers) {
  switch (mode) {
    case zero::Recompute::kBlocks: return 0;
    case zero::Recompute::kAttentionOnly: return static_cast<double>(layers < 0 ? kAllLayers : std::min(layers, kAllLayers));
    case zero::Recompute::kNone: return static_cast<double>(layers < 0 ? 2 * kAllLayers : kAllLayers + std::min(layers, kAllLayers));
  }
  return 0;
}

std::pair<zero::Recompute, int64_t> recompute_from_order(double order) {
  const auto o = static_cast<int64_t>(order);
  if (o <= 0) return {zero::Recompute::kBlocks, -1};
  if (o < kAllLayers) return {zero::Recompute::kAttentionOnly, o};
  if (o == kAllLayers) return {zero::Recompute::kAttentionOnly, -1};
  if (o < 2 * kAllLayers) return {zero::Recompute::kNone, o - kAllLayers};
  return {zero::Recompute::kNone, -1};
}

bool activations_fit(int64_t others, int64_t activations, int64_t gpu_bytes) {
  return others + activations + activations / 8 + reserve_bytes(others + activations) <= gpu_bytes;
}

}  // namespace tiller::job
