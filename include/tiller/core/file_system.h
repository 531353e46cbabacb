// The file operations that checkpoints and exports are made of, behind an interface that tests can
// replace (leveldb's Env): a full disk part-way through a file, a failed rename, a failed fsync
// are then tested deterministically, and each must leave the previous checkpoint the one in use.
//
// Every operation throws IoError naming the path and the system's reason. Thread-safe: the local
// file system has no state; a replacement must be as safe as the code that uses it needs.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace tiller {

// A file being written: append, then sync (data on disk), then close. Destroying it unsynced
// closes it; the caller removes what it does not keep.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual void append(const void* data, size_t size) = 0;
  virtual void sync() = 0;   // fsync
  virtual void close() = 0;  // idempotent
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Creates (or truncates) `path` for writing.
  virtual std::unique_ptr<WritableFile> create(const std::string& path) = 0;
  // rename(2): atomically replaces `to` (a file, or an empty directory) with `from`.
  virtual void rename(const std::string& from, const std::string& to) = 0;
  // fsync of a directory, so the creations and renames in it survive a crash.
  virtual void sync_dir(const std::string& dir) = 0;
  virtual void make_dirs(const std::string& dir) = 0;       // mkdir -p
  virtual void remove_file(const std::string& path) = 0;    // no error when absent
  virtual void remove_tree(const std::string& path) = 0;    // rm -r; no error when absent
  virtual bool exists(const std::string& path) = 0;

  // The one in use: the local file system, unless a test installed another (Override).
  static FileSystem& current();
  static FileSystem& local();

  // Installs `fs` for the lifetime of this object (tests; not while other threads write files).
  class Override {
   public:
    explicit Override(FileSystem& fs);
    ~Override();
    Override(const Override&) = delete;
    Override& operator=(const Override&) = delete;

   private:
    FileSystem* previous_;
  };
};

}  // namespace tiller
