#include "tiller/core/tls.h"

#include <optional>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller {

bool is_loopback_host(const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  return h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0;
}

std::string read_secret_file(const std::string& path, const std::string& what) {
  const std::optional<std::string> text = read_file(path);
  const std::string line = text ? text->substr(0, text->find('\n')) : std::string();
  if (line.empty() || line == "\r")
    throw ConfigError(fmt::format("{} {}: cannot read a token from its first line", what, path));
  return line.back() == '\r' ? line.substr(0, line.size() - 1) : line;
}

bool secrets_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace tiller
