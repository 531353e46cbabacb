// What algo.logprob_match = bitwise cannot have in an engine, as one rule for the two places that
// check it: the config at load (config.cpp, before any rank starts) and the engine's model runner
// at start (a `tiller engine` or a test has no config). Private to src.
#pragma once

#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace tiller {

// One line naming the key to change; "" when the engine can match the trainer bit for bit.
inline std::string bitwise_engine_conflict(bool fp8_weights, bool fp8_kv_cache, int64_t tp) {
  if (fp8_weights)
    return "algo.logprob_match = bitwise needs engines.quantization = none: the trainer computes in bf16, an FP8 "
           "engine's products differ from its by design";
  if (fp8_kv_cache)
    return "algo.logprob_match = bitwise needs engines.kv_cache_dtype = auto: an FP8 KV cache gives the engine other "
           "keys and values than the trainer's";
  if (tp > 1)
    return fmt::format("algo.logprob_match = bitwise needs engines.tp = 1 (got {}): a tensor-parallel engine adds "
                       "o_proj's and down_proj's partial sums across its ranks, an order the trainer's full-width "
                       "matmul does not share",
                       tp);
  return "";
}

}  // namespace tiller
