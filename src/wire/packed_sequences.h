// A micro-batch's sequences as the protocol carries them (private to src/wire).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tiller::wire {

// Whole sequences packed back to back (prompt + response each), or, under sequence parallelism,
// one rank's rows of such a packed row (zero/sequence_parallel.h: SequenceSplit cuts it).
//
// Row t "is a response row" when its next token is a response token: rows prompt_len - 1 ..
// seq_len - 2 of each sequence. Per-response-token arrays (log-probs, advantages, ...) follow the
// response rows in order, so a slice's part of such an array is a contiguous range of it.
struct PackedSequences {
  at::Tensor tokens;       // int64: rows [first_row, first_row + tokens.numel()) of the packed row
  at::Tensor seq_lens;     // int64 [B]: every sequence of the packed row
  at::Tensor prompt_lens;  // int64 [B], each in [1, seq_len)
  int64_t first_row = 0;
  int64_t next_token = 0;  // the token of row first_row + n (a slice's last target); 0 past the end
  // Routing replay: int16 [held rows, sparse layers x k], the engine's experts of each held row
  // (-1: none recorded, the model routes the row itself); undefined without it.
  at::Tensor routes;

  int64_t size() const { return seq_lens.defined() ? seq_lens.numel() : 0; }  // sequences of the row
  int64_t rows() const;               // tokens of the whole packed row
  int64_t held() const { return tokens.defined() ? tokens.numel() : 0; }
  bool whole() const { return first_row == 0 && held() == rows(); }
  int64_t response_tokens() const;    // response rows held (the whole row: sum of seq_len - prompt_len)
  int64_t response_before() const;    // response rows before first_row
  int64_t ends() const;               // sequences whose last row is held (they get reward scores)
  int64_t ends_before() const;        // sequences that end before first_row
  // The slices of `parts` ranks (rank j's is [j]), cut by SequenceSplit; a whole row when parts == 1.
  std::vector<PackedSequences> cut(int parts) const;
};

}  // namespace tiller::wire
