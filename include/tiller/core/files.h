// Small file helpers shared by the subsystems.
#pragma once

#include <optional>
#include <string>

namespace tiller {

// The whole file, byte for byte; nullopt when it cannot be opened (the caller names what the
// file is for in its own error).
std::optional<std::string> read_file(const std::string& path);

}  // namespace tiller
