#include "tiller/core/file_system.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller {
namespace {

std::string reason() { return std::strerror(errno); }

class LocalFile final : public WritableFile {
 public:
  LocalFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~LocalFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  void append(const void* data, size_t size) override {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t w = ::write(fd_, p, size);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw IoError(fmt::format("{}: write failed: {}", path_, w < 0 ? reason() : "no progress"));
      p += w;
      size -= static_cast<size_t>(w);
    }
  }
  void sync() override {
    if (::fsync(fd_) != 0) throw IoError(fmt::format("{}: fsync failed: {}", path_, reason()));
  }
  void close() override {
    if (fd_ < 0) return;
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw IoError(fmt::format("{}: close failed: {}", path_, reason()));
  }

 private:
  std::string path_;
  int fd_;
};

int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

class LocalFileSystem final : public FileSystem {
 public:
  std::unique_ptr<WritableFile> create(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw IoError(fmt::format("{}: cannot create: {}", path, reason()));
    return std::make_unique<LocalFile>(path, fd);
  }
  void rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0)
      throw IoError(fmt::format("cannot rename {} to {}: {}", from, to, reason()));
  }
  void sync_dir(const std::string& dir) override {
    const std::string d = dir.empty() ? "." : dir;
    const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) throw IoError(fmt::format("{}: cannot open the directory to sync it: {}", d, reason()));
    const int rc = ::fsync(fd);
    const std::string why = rc != 0 ? reason() : "";
    ::close(fd);
    // Some file systems cannot sync a directory (EINVAL); their renames are as durable as they get.
    if (rc != 0 && why != std::strerror(EINVAL))
      throw IoError(fmt::format("{}: fsync of the directory failed: {}", d, why));
  }
  void make_dirs(const std::string& dir) override {
    std::string partial;
    size_t pos = 0;
    while (pos != std::string::npos) {
      pos = dir.find('/', pos + 1);
      partial = dir.substr(0, pos);
      if (partial.empty()) continue;
      if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
        throw IoError(fmt::format("{}: cannot create the directory: {}", partial, reason()));
    }
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw IoError(fmt::format("{}: cannot create the directory: it exists and is not one", dir));
  }
  void remove_file(const std::string& path) override {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      throw IoError(fmt::format("{}: cannot remove: {}", path, reason()));
  }
  void remove_tree(const std::string& path) override {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) return;  // absent
    if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
      throw IoError(fmt::format("{}: cannot remove: {}", path, reason()));
  }
  bool exists(const std::string& path) override {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;
  }
};

std::atomic<FileSystem*> g_current{nullptr};

}  // namespace

FileSystem& FileSystem::local() {
  static LocalFileSystem fs;
  return fs;
}

FileSystem& FileSystem::current() {
  FileSystem* fs = g_current.load();
  return fs ? *fs : local();
}

FileSystem::Override::Override(FileSystem& fs) : previous_(g_current.exchange(&fs)) {}
FileSystem::Override::~Override() { g_current.store(previous_); }

}  // namespace tiller
