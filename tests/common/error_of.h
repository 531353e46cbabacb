// Tests' helper: the message of what `f` throws ("" when it throws nothing).
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace tiller {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace tiller
