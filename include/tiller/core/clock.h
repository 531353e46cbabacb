// Time helpers shared by the controller, the ranks and the benchmarks: wall-clock microseconds
// for traces (comparable across the processes of one machine, and across machines as far as
// their clocks agree), steady-clock seconds for durations.
#pragma once

#include <chrono>

namespace tiller {

// Microseconds since the Unix epoch (Chrome trace timestamps).
inline double wall_us() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

// Seconds from `t` to now on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace tiller
