// The file system behind checkpoints, with faults injected: a file written atomically is the old
// one or the new one, never a part, whatever fails on the way.
#include <filesystem>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "faulty_file_system.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller {
namespace {

std::string scratch(const std::string& name) {
  const std::string d = std::string(TILLER_TEST_SCRATCH) + "/file_system/" + name;
  remove_tree(d);
  FileSystem::local().make_dirs(d);
  return d;
}

// Leftover temporaries of write_file_atomic in `dir`.
int temporaries(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    n += e.path().filename().string().find(".tmp.") != std::string::npos;
  return n;
}

TEST(FileSystem, AnAtomicWriteIsTheOldFileOrTheNewOneUnderEveryFault) {
  const std::string d = scratch("atomic");
  const std::string path = d + "/state.json";
  write_file_atomic(path, "old contents");
  const std::string fresh(100000, 'n');
  struct Case {
    const char* name;
    std::function<void(test::FaultyFileSystem&)> arm;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"a full disk part-way", [](auto& f) { f.full_disk_in = "state.json.tmp"; f.disk_left = 4096; },
       "No space left on device"},
      {"a failed fsync", [](auto& f) { f.fail_sync_in = "state.json.tmp"; }, "fsync failed: Input/output error"},
      {"a failed rename", [](auto& f) { f.fail_rename_to = "state.json"; }, "cannot rename"},
  };
  for (const Case& c : cases) {
    test::FaultyFileSystem faulty;
    c.arm(faulty);
    FileSystem::Override use(faulty);
    try {
      write_file_atomic(path, fresh);
      ADD_FAILURE() << c.name << ": the write succeeded";
    } catch (const IoError& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind(path + ": write failed (", 0), 0u) << c.name << ": " << m;
      EXPECT_NE(m.find(c.says), std::string::npos) << c.name << ": " << m;
      EXPECT_NE(m.find("the file is as it was"), std::string::npos) << m;
    }
    EXPECT_EQ(faulty.faults, 1) << c.name;
    EXPECT_TRUE(*read_file(path) == "old contents") << c.name;
    EXPECT_EQ(temporaries(d), 0) << c.name;
  }
  // A failed fsync of the directory after the rename: the new file is in place (and whole), and the
  // caller hears that its durability is not known.
  test::FaultyFileSystem faulty;
  faulty.fail_sync_dir_exact = d;
  {
    FileSystem::Override use(faulty);
    EXPECT_THROW(write_file_atomic(path, fresh), IoError);
  }
  EXPECT_TRUE(*read_file(path) == fresh);
  write_file_atomic(path, "after");  // the local file system again
  EXPECT_EQ(*read_file(path), "after");
}

TEST(FileSystem, MakeDirsAndRemoveTree) {
  const std::string d = scratch("dirs");
  FileSystem& fs = FileSystem::local();
  fs.make_dirs(d + "/a/b/c");
  fs.make_dirs(d + "/a/b/c");  // already there
  EXPECT_TRUE(fs.exists(d + "/a/b/c"));
  write_file_atomic(d + "/a/b/f", "x");
  EXPECT_THROW(fs.make_dirs(d + "/a/b/f/g"), IoError);  // a file in the way
  fs.remove_tree(d + "/a");
  EXPECT_FALSE(fs.exists(d + "/a"));
  fs.remove_tree(d + "/a");  // absent: nothing to do
  fs.remove_file(d + "/nope");
}

}  // namespace
}  // namespace tiller
