#include "controller/batch.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::controller {

wire::PackedSequences pack_sequences(const Rollout& ro, const std::vector<int64_t>& samples) {
  int64_t total = 0;
  for (int64_t s : samples) total += ro.seq_len(s);
  const auto n = static_cast<int64_t>(samples.size());
  wire::PackedSequences b;
  b.tokens = at::empty({total}, at::kLong);
  b.seq_lens = at::empty({n}, at::kLong);
  b.prompt_lens = at::empty({n}, at::kLong);
  int64_t* tp = b.tokens.data_ptr<int64_t>();
  int64_t* sl = b.seq_lens.data_ptr<int64_t>();
  int64_t* pl = b.prompt_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = samples[static_cast<size_t>(i)];
    const auto from = ro.tokens.begin() + ro.seq_offset[s];
    tp = std::copy(from, from + ro.seq_len(s), tp);
    sl[i] = ro.seq_len(s);
    pl[i] = ro.prompt_len[s];
  }
  // Routing replay: the engine's experts of each row (-1 where none were recorded).
  bool any = false;
  for (int64_t s : samples) any |= ro.has_routes(s);
  if (any) {
    const int64_t w = ro.route_width;
    b.routes = at::full({total, w}, -1, at::kShort);
    int16_t* rp = b.routes.data_ptr<int16_t>();
    for (int64_t s : samples) {
      if (ro.has_routes(s)) std::copy(ro.routes.begin() + ro.route_offset[s], ro.routes.begin() + ro.route_offset[s + 1], rp);
      rp += ro.seq_len(s) * w;
    }
  }
  return b;
}

at::Tensor gather_tokens(const Rollout& ro, const std::vector<float>& values, const std::vector<int64_t>& samples) {
  int64_t total = 0;
  for (int64_t s : samples) total += ro.response_len[s];
  at::Tensor out = at::empty({total}, at::kFloat);
  float* p = out.data_ptr<float>();
  for (int64_t s : samples) {
    const auto from = values.begin() + ro.resp_offset[s];
    p = std::copy(from, from + ro.response_len[s], p);
  }
  return out;
}

at::Tensor gather_mask(const Rollout& ro, const std::vector<int64_t>& samples) {
  TILLER_CHECK(ro.layout.turns, "gather_mask: the rollout has no loss mask");
  int64_t total = 0;
  for (int64_t s : samples) total += ro.response_len[s];
  at::Tensor out = at::empty({total}, at::kByte);
  uint8_t* p = out.data_ptr<uint8_t>();
  for (int64_t s : samples) {
    const auto from = ro.loss_mask.begin() + ro.resp_offset[s];
    p = std::copy(from, from + ro.response_len[s], p);
  }
  return out;
}

void scatter_tokens(const Rollout& ro, std::vector<float>& values, const std::vector<int64_t>& samples,
                    const at::Tensor& t) {
  int64_t total = 0;
  for (int64_t s : samples) total += ro.response_len[s];
  if (t.numel() != total)
    throw CommError(fmt::format("an answer carries {} values for {} response tokens", t.numel(), total));
  const at::Tensor c = t.to(at::kFloat).contiguous();
  const float* p = c.data_ptr<float>();
  for (int64_t s : samples) {
    std::copy(p, p + ro.response_len[s], values.begin() + ro.resp_offset[s]);
    p += ro.response_len[s];
  }
}

}  // namespace tiller::controller
