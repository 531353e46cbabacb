#include "tiller/dist/communicator.h"

#include "tiller/core/error.h"
#include "tiller/dist/mpi_env.h"

#ifdef TILLER_WITH_NCCL
#include "nccl_communicator.h"
#endif

namespace tiller::dist {

bool MpiEnv::have_nccl() {
#ifdef TILLER_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Communicator> MpiEnv::nccl(Communicator& over, int device, const std::string& name, double timeout_s) {
#ifdef TILLER_WITH_NCCL
  return make_nccl_communicator(over, device, name, timeout_s);
#else
  (void)over;
  (void)device;
  (void)timeout_s;
  throw CommError("NCCL communicator '" + name + "' requested, but this is the CPU build of tiller; "
                  "build with scripts/gpu/build.sh on a CUDA machine, or set cluster.backend=mpi");
#endif
}

}  // namespace tiller::dist
