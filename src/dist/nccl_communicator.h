// The NCCL backend of Communicator (CUDA tensors). Private to src/dist; GPU build only.
//
// Each communicator is non-blocking (ncclConfig_t.blocking = 0) and has its own stream. An op
// waits for the caller's current stream (event), runs on the communicator's stream, and records a
// completion event. A watchdog thread checks every pending op against its deadline and the
// communicator's async error; on a miss it aborts the communicator (ncclCommAbort, which also
// frees the GPU kernels stuck in it) and records the op, group, rank and sequence number, which
// Work::wait and every later call rethrow.
#pragma once

#include <memory>
#include <string>

#include "tiller/dist/communicator.h"

namespace tiller::dist {

// Collective over `over` (an MPI communicator whose ranks become this one's, in order): rank 0
// makes the NCCL unique id and broadcasts it over `over`.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& over, int device, const std::string& name,
                                                     double timeout_s);

}  // namespace tiller::dist
