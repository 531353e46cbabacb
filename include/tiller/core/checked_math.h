// Sums and products of sizes that come from users (config keys, request fields, file headers):
// an overflow is an error that names what was being computed, never a wrapped value that then
// passes a bounds check.
#pragma once

#include <cstdint>
#include <string_view>

#include "tiller/core/error.h"

namespace tiller {

// a + b and a * b, or a ConfigError "<what> overflows 64-bit integers (a + b)". `what` names the
// quantity in the user's terms, e.g. "rollout.max_prompt_tokens + rollout.max_new_tokens".
inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r))
    throw ConfigError(fmt::format("{} overflows 64-bit integers ({} + {})", what, a, b));
  return r;
}

inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r))
    throw ConfigError(fmt::format("{} overflows 64-bit integers ({} x {})", what, a, b));
  return r;
}

}  // namespace tiller
