#include "wire/packed_sequences.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "tiller/core/error.h"
#include "tiller/zero/sequence_parallel.h"

namespace tiller::wire {

namespace {

// Calls f(response_begin, response_end, last_row) for each sequence of `b`, in rows of the whole
// packed row.
template <typename F>
void for_each_sequence(const PackedSequences& b, F&& f) {
  if (!b.seq_lens.defined()) return;
  const int64_t* sl = b.seq_lens.data_ptr<int64_t>();
  const int64_t* pl = b.prompt_lens.data_ptr<int64_t>();
  int64_t off = 0;
  for (int64_t i = 0; i < b.seq_lens.numel(); ++i) {
    f(off + pl[i] - 1, off + sl[i] - 1, off + sl[i] - 1);
    off += sl[i];
  }
}

int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) { return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0)); }

}  // namespace

int64_t PackedSequences::rows() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t, int64_t, int64_t last) { n = last + 1; });
  return n;
}

int64_t PackedSequences::response_tokens() const {
  int64_t n = 0;
  const int64_t a = first_row, b = first_row + held();
  for_each_sequence(*this, [&](int64_t r0, int64_t r1, int64_t) { n += overlap(r0, r1, a, b); });
  return n;
}

int64_t PackedSequences::response_before() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t r0, int64_t r1, int64_t) { n += overlap(r0, r1, 0, first_row); });
  return n;
}

int64_t PackedSequences::ends() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t, int64_t, int64_t last) { n += last >= first_row && last < first_row + held(); });
  return n;
}

int64_t PackedSequences::ends_before() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t, int64_t, int64_t last) { n += last < first_row; });
  return n;
}

std::vector<PackedSequences> PackedSequences::cut(int parts) const {
  TILLER_CHECK(whole(), "cutting a packed row that is itself a slice");
  if (parts == 1) return {*this};
  const zero::SequenceSplit split{rows(), parts};
  std::vector<PackedSequences> out;
  for (int j = 0; j < parts; ++j) {
    PackedSequences s;
    s.seq_lens = seq_lens;
    s.prompt_lens = prompt_lens;
    s.first_row = split.begin(j);
    const int64_t end = s.first_row + split.size(j);
    s.tokens = tokens.narrow(0, s.first_row, split.size(j));
    if (routes.defined()) s.routes = routes.narrow(0, s.first_row, split.size(j));
    s.next_token = end < split.rows ? tokens.data_ptr<int64_t>()[end] : 0;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace tiller::wire
