// The NCCL backend of Communicator (CUDA tensors). Private to src/dist; GPU build only.
//
// Design (docs/architecture.md, "NCCL communicators"):
//  - Each communicator owns one launcher thread that makes every NCCL call on it, on a blocking
//    NCCL communicator. The caller's thread only records an event on its current stream and
//    queues the op (a few microseconds); the launcher makes the communicator's stream wait on
//    that event, calls NCCL and records a completion event. NCCL's own non-blocking mode would
//    give the same protection but starts a thread per op (100-300 us per collective, measured).
//  - A host-side hang inside NCCL (a peer that never joins a connection setup) stalls only the
//    launcher: the caller's Work::wait still ends at its deadline with TimeoutError.
//  - A watchdog thread checks every pending op against its deadline and the communicator's async
//    error; on a miss it aborts the communicator (ncclCommAbort frees the GPU kernels stuck in
//    it) and records op, group, rank and sequence number, which every later call rethrows.
//    When the launcher is itself stuck inside NCCL the abort is skipped (NCCL forbids freeing a
//    communicator under a running call); the process must exit, as after any timeout.
#pragma once

#include <memory>
#include <string>

#include "tiller/dist/communicator.h"

namespace tiller::dist {

// Collective over `over` (an MPI communicator whose ranks become this one's, in order): rank 0
// makes the NCCL unique id and broadcasts it over `over`. Bounded by timeout_s.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& over, int device, const std::string& name,
                                                     double timeout_s);

}  // namespace tiller::dist
