// Errors. Inside a subsystem, broken invariants and bad input throw one of the typed exceptions
// below, usually through TILLER_CHECK (which adds file:line). At boundaries (main, thread entry
// points, RPC handlers) they become one clear line and a non-zero exit or an error status.
//
// Which type to throw:
//   ConfigError  - the user's config or command line is wrong (exit code 2)
//   CommError    - a communicator failed or was aborted
//   TimeoutError - a blocking call missed its deadline (a CommError: it aborts the communicator)
//   IoError      - a file could not be read or written
//   Error        - any other broken invariant
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/core.h>

namespace tiller {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};
class ConfigError : public Error {
 public:
  using Error::Error;
};
class CommError : public Error {
 public:
  using Error::Error;
};
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};
class IoError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void throw_check_failure(const char* file, int line, const char* cond,
                                      const std::string& message);
template <typename... Args>
std::string format_check_message(fmt::format_string<Args...> f, Args&&... args) {
  return fmt::format(f, std::forward<Args>(args)...);
}
inline std::string format_check_message() { return {}; }
}  // namespace detail

// Exit code main() returns for an exception of this type: 2 for config/usage errors, 1 otherwise.
int exit_code_for(const std::exception& e);

// e.what() for a one-line report: without the C++ stack trace that libtorch appends to its errors
// (a CUDA out-of-memory, a cuBLAS failure), and with no trailing blank.
std::string error_line(const std::exception& e);

}  // namespace tiller

// TILLER_CHECK(cond, "fmt {}", args...): throws tiller::Error("file:line: check 'cond' failed: msg").
#define TILLER_CHECK(cond, ...)                                                       \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      ::tiller::detail::throw_check_failure(                                          \
          __FILE__, __LINE__, #cond, ::tiller::detail::format_check_message(__VA_ARGS__)); \
    }                                                                                 \
  } while (0)
