// What a caller asks of sampling: the parameters of one prompt's generation (the rules are in
// sampling.h). Plain data, shared by the reference generator, the engine and its wire format.
#pragma once

#include <cstdint>
#include <vector>

namespace tiller::model {

// The longest completion any caller may ask for (the engine's request validation, the config's
// rollout.max_new_tokens), so that prompt + max_new_tokens cannot overflow.
inline constexpr int64_t kMaxNewTokens = int64_t{1} << 24;

struct SamplingParams {
  bool greedy = false;
  double temperature = 1.0;  // > 0
  double top_p = 1.0;        // (0, 1]
  int64_t top_k = 0;         // 0: off
  double min_p = 0.0;        // [0, 1)
  uint64_t seed = 0;         // prompt i (sample i of an engine request) draws with seed + i
  int64_t max_new_tokens = 128;
  std::vector<int64_t> stop_token_ids;

  // Throws ConfigError naming the field for values out of range.
  void validate() const;
};

}  // namespace tiller::model
