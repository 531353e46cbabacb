// A FileSystem for tests that passes everything to the local one, except the faults it is told to
// inject (leveldb's ErrorEnv): a full disk part-way through a file, a failed rename, a failed
// fsync. Each fault fires on the first path that contains its pattern, and is counted.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/file_system.h"

namespace tiller::test {

class FaultyFileSystem final : public FileSystem {
 public:
  std::string full_disk_in;    // a file whose path contains this: ENOSPC once `disk_left` bytes are in it
  size_t disk_left = 0;
  std::string fail_rename_to;  // a rename whose target contains this fails (EIO)
  std::string fail_rename_exact_to;  // a rename to exactly this path fails (EIO)
  std::string fail_sync_in;    // fsync of a file or directory whose path contains this fails (EIO)
  std::string fail_sync_dir_exact;  // fsync of exactly this directory fails (EIO)
  int faults = 0;              // injected so far

  std::unique_ptr<WritableFile> create(const std::string& path) override {
    return std::make_unique<File>(*this, path, local().create(path));
  }
  void rename(const std::string& from, const std::string& to) override {
    if (hit(fail_rename_to, to) || (!fail_rename_exact_to.empty() && to == fail_rename_exact_to))
      fail(fmt::format("cannot rename {} to {}", from, to), EIO);
    local().rename(from, to);
  }
  void sync_dir(const std::string& dir) override {
    if (hit(fail_sync_in, dir) || (!fail_sync_dir_exact.empty() && dir == fail_sync_dir_exact))
      fail(dir + ": fsync of the directory failed", EIO);
    local().sync_dir(dir);
  }
  void make_dirs(const std::string& dir) override { local().make_dirs(dir); }
  void remove_file(const std::string& path) override { local().remove_file(path); }
  void remove_tree(const std::string& path) override { local().remove_tree(path); }
  bool exists(const std::string& path) override { return local().exists(path); }

 private:
  class File final : public WritableFile {
   public:
    File(FaultyFileSystem& fs, std::string path, std::unique_ptr<WritableFile> f)
        : fs_(fs), path_(std::move(path)), f_(std::move(f)), full_(fs.hit(fs.full_disk_in, path_)) {}
    void append(const void* data, size_t size) override {
      if (full_) {  // write what still fits, then the disk is full
        const size_t fits = std::min(size, fs_.disk_left);
        f_->append(data, fits);
        fs_.disk_left -= fits;
        if (fits < size) fs_.fail(path_ + ": write failed", ENOSPC);
        return;
      }
      f_->append(data, size);
    }
    void sync() override {
      if (fs_.hit(fs_.fail_sync_in, path_)) fs_.fail(path_ + ": fsync failed", EIO);
      f_->sync();
    }
    void close() override { f_->close(); }

   private:
    FaultyFileSystem& fs_;
    std::string path_;
    std::unique_ptr<WritableFile> f_;
    bool full_;
  };

  bool hit(const std::string& pattern, const std::string& path) const {
    return !pattern.empty() && path.find(pattern) != std::string::npos;
  }
  [[noreturn]] void fail(const std::string& what, int err) {
    ++faults;
    throw IoError(fmt::format("{}: {} (injected)", what, std::strerror(err)));
  }
};

}  // namespace tiller::test
