// Shared state of the multi-rank tests: the MPI environment and the communicator under test
// (MPI backend on CPU, or NCCL on one GPU per rank when TILLER_TEST_BACKEND=nccl).
#pragma once

#include <ATen/ATen.h>

#include "tiller/dist/communicator.h"
#include "tiller/dist/mpi_env.h"

namespace tiller::test {

struct MpiTestEnv {
  dist::MpiEnv* env = nullptr;
  dist::Communicator* world = nullptr;  // MPI backend, always
  dist::Communicator* comm = nullptr;   // the backend under test
  at::TensorOptions device;             // where the backend's tensors live
};

MpiTestEnv& mpi_test_env();

}  // namespace tiller::test
