// Small file helpers shared by the subsystems.
#pragma once

#include <optional>
#include <string>

namespace tiller {

// The whole file, byte for byte; nullopt when it cannot be opened (the caller names what the
// file is for in its own error).
std::optional<std::string> read_file(const std::string& path);

// Writes `text` to path + ".tmp.<pid>", fsyncs, renames it over `path` and fsyncs the directory:
// readers see the old file or the new one, never a partial one. Throws IoError naming the path.
void write_file_atomic(const std::string& path, const std::string& text);

// Removes a file or a directory tree (no error if absent); throws IoError naming what could not
// be removed. (Not std::filesystem::remove_all: on the GPU host libtorch.so exports its own
// std::filesystem symbols, which the dynamic linker binds first and which crash.)
void remove_tree(const std::string& path);

// fsync of a directory, so renames and creations inside it survive a crash. IoError when it fails
// (a file system that cannot sync directories at all is accepted).
void fsync_dir(const std::string& dir);

// The directory part of `path` ("." for a bare name).
std::string parent_dir(const std::string& path);

// All of these go through FileSystem::current() (tiller/core/file_system.h), which tests replace
// to inject faults.

}  // namespace tiller
