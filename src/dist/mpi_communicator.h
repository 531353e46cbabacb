// The MPI backend of Communicator (CPU tensors). Private to src/dist.
//
// Collectives are built from tagged point-to-point messages, not MPI's own collectives: a
// collective's tag carries its sequence number, so a rank that skips one (or arrives after the
// others gave up) never matches a different collective's messages; its operation times out
// instead. Reductions run in rank order, so every rank computes the same bits.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "tiller/dist/communicator.h"

namespace tiller::dist {

// Wraps (and duplicates) `comm`; the duplicate is freed with the communicator.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name, double timeout_s);
// "world ranks 1,2" of an MPI-backend communicator's ranks (the watchdog's lines); "its group" else.
std::string peers_of(const Communicator& comm);

}  // namespace tiller::dist
