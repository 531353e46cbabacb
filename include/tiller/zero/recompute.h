// Activation recomputation modes of a trained model (train.recompute), in a header of its own so
// that the memory plan can name them without the model's headers.
#pragma once

#include <string>

namespace tiller {
enum class RecomputeChoice;  // train.recompute (tiller/core/config.h)
}

namespace tiller::zero {

// What a trained block keeps for its backward pass (train.recompute; docs/zero.md):
//  kBlocks         only its input; the backward re-gathers the block and recomputes all of it
//                  (block-level activation checkpointing: least memory, one more forward)
//  kAttentionOnly  its input and the MLP's activations; the backward recomputes the attention
//                  half (norm, q/k/v, RoPE, attention, o_proj), ~15% of a block's FLOPs
//  kNone           every activation autograd saves; nothing is recomputed (most memory)
// In every mode the gathered weights are freed after the forward and gathered again for the
// backward (ZeRO-3); the gathers and reductions are the same, so ranks may differ without
// sequence parallelism, whose exchanges a recomputation repeats (a role's ranks use one mode).
// Ordered from least to most memory.
enum class Recompute { kBlocks = 0, kAttentionOnly = 1, kNone = 2 };
const char* recompute_name(Recompute r);
// "blocks", "attention_only" or "none"; ConfigError naming `key` otherwise.
Recompute parse_recompute(const std::string& text, const std::string& key);
// train.recompute's mode; `auto` (which the memory plan resolves before models are built) is
// kBlocks, the least memory.
Recompute recompute_of(RecomputeChoice c);
// The config's spelling of a mode.
RecomputeChoice recompute_choice(Recompute r);

}  // namespace tiller::zero
