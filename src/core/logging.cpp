#include "tiller/core/logging.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "tiller/core/error.h"

namespace tiller::log {
namespace {

std::atomic<Level> g_level{Level::kInfo};
std::mutex g_mutex;
int g_rank = 0;
std::string g_role = "-";

std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto lg = spdlog::stderr_color_mt("tiller");
    lg->set_level(spdlog::level::trace);  // filtering happens in g_level
    return lg;
  }();
  return l;
}

spdlog::level::level_enum to_spdlog(Level l) {
  switch (l) {
    case Level::kTrace: return spdlog::level::trace;
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

void apply_pattern() {
  logger()->set_pattern(fmt::format("[%H:%M:%S.%e] [%^%l%$] [{} {}] %v", g_rank, g_role));
}

}  // namespace

Level parse_level(std::string_view name, std::string_view what) {
  static const std::pair<const char*, Level> kNames[] = {
      {"trace", Level::kTrace}, {"debug", Level::kDebug}, {"info", Level::kInfo},
      {"warn", Level::kWarn},   {"warning", Level::kWarn}, {"error", Level::kError},
      {"off", Level::kOff}};
  for (const auto& [n, l] : kNames) {
    if (name == n) return l;
  }
  throw ConfigError(fmt::format("{}: '{}' is not a log level; use one of trace, debug, info, warn, error, off",
                                what, name));
}

void init(int rank, std::string_view role, Level level) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_rank = rank;
  g_role = std::string(role);
  if (const char* env = std::getenv("TILLER_LOG_LEVEL"); env != nullptr && *env != '\0') {
    level = parse_level(env, "TILLER_LOG_LEVEL");
  }
  g_level = level;
  apply_pattern();
}

void set_role(std::string_view role) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_role = std::string(role);
  apply_pattern();
}

Level level() { return g_level.load(std::memory_order_relaxed); }

void write(Level level, std::string_view message) {
  logger()->log(to_spdlog(level), "{}", message);
}

}  // namespace tiller::log
