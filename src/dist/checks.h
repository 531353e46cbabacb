// Argument checks shared by the Communicator backends. Private to src/dist.
#pragma once

#include "tiller/core/error.h"
#include "tiller/dist/communicator.h"

namespace tiller::dist {

inline void check_peer(const Communicator& comm, int peer, const char* op) {
  TILLER_CHECK(peer >= 0 && peer < comm.size() && peer != comm.rank(),
               "{} on '{}': peer {} is not another rank of a group of {}", op, comm.name(), peer, comm.size());
}

}  // namespace tiller::dist
