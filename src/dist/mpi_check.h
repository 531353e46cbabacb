// Checked MPI calls. The job sets MPI_ERRORS_RETURN, so a failing call returns its code instead of
// aborting; every call goes through TILLER_MPI, which turns a code other than MPI_SUCCESS into a
// CommError naming the call, what it was for (the op, group and rank) and MPI's own words.
// Private to src/dist.
#pragma once

#include <mpi.h>

#include <string>
#include <string_view>

#include <fmt/format.h>

#include "dist/call_failure.h"
#include "tiller/core/error.h"

namespace tiller::dist {

// MPI's text for an error code ("MPI_ERR_COMM: invalid communicator").
inline std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error code {}", rc);
  return std::string(text, static_cast<size_t>(len));
}

[[noreturn]] inline void throw_mpi_error(std::string_view expr, int rc, const std::string& context) {
  throw CommError(call_failure(context, expr, mpi_error_text(rc)));
}

}  // namespace tiller::dist

// TILLER_MPI(MPI_Isend(...), "send #{} on group '{}' (rank {})", seq, name, rank): the context
// says what the call was for; the message adds the call's name and MPI's error text.
#define TILLER_MPI(call, ...)                                                                  \
  do {                                                                                         \
    const int tiller_mpi_rc_ = (call);                                                         \
    if (tiller_mpi_rc_ != MPI_SUCCESS)                                                         \
      ::tiller::dist::throw_mpi_error(#call, tiller_mpi_rc_, ::fmt::format(__VA_ARGS__));      \
  } while (0)
