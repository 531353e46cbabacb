#include "tiller/core/error.h"

#include <cctype>
#include <cstring>

namespace tiller {
namespace detail {

void throw_check_failure(const char* file, int line, const char* cond, const std::string& message) {
  // Keep the path short: "src/dist/rank_plan.cpp" rather than the absolute build path.
  const char* shown = file;
  for (const char* marker : {"/src/", "/include/", "/apps/", "/tests/"}) {
    if (const char* p = std::strstr(file, marker)) {
      shown = p + 1;
      break;
    }
  }
  std::string what = fmt::format("{}:{}: ", shown, line);
  what += message.empty() ? fmt::format("check '{}' failed", cond) : message;
  throw Error(what);
}

}  // namespace detail

std::string error_line(const std::exception& e) {
  std::string s = e.what();
  if (const size_t cut = s.find("\nException raised from "); cut != std::string::npos) s.resize(cut);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

int exit_code_for(const std::exception& e) {
  return dynamic_cast<const ConfigError*>(&e) != nullptr ? 2 : 1;
}

}  // namespace tiller
