#include "data/records.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "python/parquet.h"
#include "tiller/core/error.h"

namespace tiller::data {
namespace {

bool is_parquet(const std::string& path) {
  const auto ends = [&](const char* suffix) {
    const size_t n = std::strlen(suffix);
    return path.size() >= n && path.compare(path.size() - n, n, suffix) == 0;
  };
  return ends(".parquet") || ends(".pq");
}

nlohmann::ordered_json parse_record(const std::string& where, const std::string& text) {
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::ordered_json::exception& e) {
    throw ConfigError(fmt::format("{}: not valid JSON ({})", where, e.what()));
  }
  if (!j.is_object()) throw ConfigError(fmt::format("{}: not a JSON object", where));
  return j;
}

}  // namespace

int64_t for_each_record(const std::string& path, const std::string& what, const std::string& key,
                        const std::function<bool(const std::string&, int64_t, const nlohmann::ordered_json&)>& fn) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const std::string reason = std::strerror(errno);
    // Relative paths start from the working directory, not from the config file's.
    std::string from;
    if (!path.empty() && path[0] != '/') {
      std::error_code ec;
      from = fmt::format(" (a relative path: from {}; set {} to an absolute path, or start tiller in the directory "
                         "the config's paths are relative to)",
                         std::filesystem::current_path(ec).string(), key);
    }
    throw ConfigError(fmt::format("{}: cannot open {}: {}{}", path, what, reason, from));
  }
  if (S_ISDIR(st.st_mode))
    throw ConfigError(fmt::format("{}: is a directory, not {}; set {} to a JSONL or parquet file", path, what, key));
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
    throw ConfigError(fmt::format("{}: is not a regular file; set {} to a JSONL or parquet file", path, key));
  int64_t n = 0;
  if (is_parquet(path)) {
    python::for_each_parquet_row(path, [&](int64_t row, const std::string& json) {
      n = row;
      const std::string where = fmt::format("{}: row {}", path, row);
      return fn(where, row, parse_record(where, json));
    });
    return n;
  }
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("{}: cannot open {}", path, what));
  std::string line;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are allowed
    const std::string where = fmt::format("{}:{}", path, n);
    if (!fn(where, n, parse_record(where, line))) break;
  }
  if (in.bad()) throw IoError(fmt::format("{}: read error after line {}: {}", path, n, std::strerror(errno)));
  return n;
}

const nlohmann::ordered_json* lookup(const nlohmann::ordered_json& j, const std::string& key) {
  if (key.empty()) return nullptr;
  if (auto it = j.find(key); it != j.end()) return &*it;
  const nlohmann::ordered_json* at = &j;
  size_t from = 0;
  for (;;) {
    const size_t dot = key.find('.', from);
    const std::string part = key.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
    if (!at->is_object()) return nullptr;
    auto it = at->find(part);
    if (it == at->end()) return nullptr;
    at = &*it;
    if (dot == std::string::npos) return at;
    from = dot + 1;
  }
}

std::vector<text::ChatMessage> chat_messages(const std::string& where, const nlohmann::ordered_json& list,
                                              const std::string& key) {
  if (!list.is_array() || list.empty())
    throw ConfigError(fmt::format("{}: the messages under '{}' must be a non-empty list", where, key));
  std::vector<text::ChatMessage> out;
  for (const auto& m : list) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      throw ConfigError(
          fmt::format("{}: the messages under '{}' must be objects with string \"role\" and \"content\"", where, key));
    nlohmann::ordered_json fields = m;
    fields.erase("role");
    fields.erase("content");
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>(), fields.empty() ? "" : fields.dump()});
  }
  return out;
}

}  // namespace tiller::data
