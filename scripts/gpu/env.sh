# Sourced by the GPU scripts. NVLink multicast off everywhere: on shared GPUs it can take the
# host's GPUs out of service. mpirun gets the same variables through -x in the scripts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
tiller_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
gpu_build=${TILLER_GPU_BUILD:-$tiller_root/build-gpu}
python=${PYTHON:-python3}
# Libraries unpacked from .deb files (scripts/gpu/build.sh): gRPC's own dependencies are found
# through this path (a binary's RUNPATH covers only its direct dependencies). The device tool's
# carried .gpu replaces the unpacked prefix on every call, so a script run without build.sh
# unpacks it again here.
if [ ! -d "$tiller_root/.gpu/prefix/usr/lib" ] && compgen -G "$tiller_root/.gpu/debs/*.deb" > /dev/null; then
  for f in "$tiller_root"/.gpu/debs/*.deb; do dpkg -x "$f" "$tiller_root/.gpu/prefix"; done
fi
export LD_LIBRARY_PATH=$tiller_root/.gpu/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
