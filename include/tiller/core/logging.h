// Logging through spdlog (kept out of this header). Every line carries a `[rank role]` prefix so a
// multi-node log reads as one: "[12:00:01.123] [info] [3 actor] ...".
//
// Level: the config's logging.level, overridden by the TILLER_LOG_LEVEL environment variable
// (trace, debug, info, warn, error, off). Thread-safe.
#pragma once

#include <string>
#include <string_view>

#include <fmt/core.h>

namespace tiller::log {

enum class Level { kTrace, kDebug, kInfo, kWarn, kError, kOff };

// Parses "trace".."off"; throws ConfigError naming `what` on anything else.
Level parse_level(std::string_view name, std::string_view what = "log level");

// Sets the prefix and level. May be called again (e.g. once the rank's role is known).
// `level` is used unless TILLER_LOG_LEVEL is set.
void init(int rank, std::string_view role, Level level = Level::kInfo);
void set_role(std::string_view role);
Level level();

void write(Level level, std::string_view message);

template <typename... Args>
void trace(fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::kTrace) write(Level::kTrace, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args>
void debug(fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::kDebug) write(Level::kDebug, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::kInfo) write(Level::kInfo, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::kWarn) write(Level::kWarn, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args>
void error(fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::kError) write(Level::kError, fmt::format(f, std::forward<Args>(a)...));
}

}  // namespace tiller::log
