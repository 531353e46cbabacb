// The one message format of a failed library call (MPI, CUDA, NCCL), shared by the checking macros
// of each library (TILLER_MPI in mpi_check.h; TILLER_CUDA and TILLER_NCCL in nccl_communicator.cpp).
// Private to src/dist; host-only.
#pragma once

#include <string>
#include <string_view>

namespace tiller::dist {

// "<context>: <call> failed: <error>", the call named by its function: "MPI_Isend(buf, ...)" is
// "MPI_Isend". An empty context gives ": <call> failed: ..." for the caller to prefix.
inline std::string call_failure(std::string_view context, std::string_view call, std::string_view error) {
  std::string out(context);
  out += ": ";
  out += call.substr(0, call.find('('));
  out += " failed: ";
  out += error;
  return out;
}

}  // namespace tiller::dist
