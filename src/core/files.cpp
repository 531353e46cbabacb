#include "tiller/core/files.h"

#include <fstream>
#include <sstream>

#include <unistd.h>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/file_system.h"

namespace tiller {

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void remove_tree(const std::string& path) { FileSystem::current().remove_tree(path); }

void fsync_dir(const std::string& dir) { FileSystem::current().sync_dir(dir); }

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  FileSystem& fs = FileSystem::current();
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    auto f = fs.create(tmp);
    f->append(text.data(), text.size());
    f->sync();
    f->close();
    fs.rename(tmp, path);
  } catch (const IoError& e) {
    try {
      fs.remove_file(tmp);
    } catch (const IoError&) {  // the first failure is the one to report
    }
    throw IoError(fmt::format("{}: write failed ({}); the file is as it was", path, e.what()));
  }
  fs.sync_dir(parent_dir(path));
}

}  // namespace tiller
