#!/usr/bin/env bash
# Builds the GPU variant on the GPU host (Ubuntu 24.04, CUDA 13, PyTorch with CUDA, no network)
# against PyTorch's bundled libtorch and the NCCL that PyTorch loads (the nvidia-nccl wheel), so
# one NCCL lives in the process. What the host lacks comes from .deb files fetched beforehand by
# scripts/gpu/fetch_debs.sh and unpacked here into .gpu/prefix.
set -euo pipefail
source "$(dirname "$0")/env.sh"

prefix=$tiller_root/.gpu/prefix
if compgen -G "$tiller_root/.gpu/debs/*.deb" > /dev/null; then
  mkdir -p "$prefix"
  for f in "$tiller_root"/.gpu/debs/*.deb; do dpkg -x "$f" "$prefix"; done
fi

# The Python side of the model tests (make_hf_fixtures.py) needs sentencepiece; the host has no
# network, so its wheel travels in .gpu/wheels (scripts/gpu/fetch_debs.sh fetches it).
if ! $python -c 'import sentencepiece' 2>/dev/null && compgen -G "$tiller_root/.gpu/wheels/*.whl" > /dev/null; then
  $python -m pip install -q --no-index --find-links "$tiller_root/.gpu/wheels" sentencepiece
fi

# gRPC's CMake config links RE2 by its bare name (-lre2, from pkg-config): the linker finds it
# in the unpacked prefix through LIBRARY_PATH.
export LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}

torch_prefix=$($python -c 'import torch; print(torch.utils.cmake_prefix_path)')
nccl_root=$($python -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
echo "gpu build: torch $($python -c 'import torch; print(torch.__version__, torch.version.cuda)'), nccl at ${nccl_root:-system}"
nvcc --version | tail -1

cmake -S "$tiller_root" -B "$gpu_build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" \
  -DTILLER_CUDA=ON \
  ${nccl_root:+-DNCCL_ROOT="$nccl_root"} > "$gpu_build.configure.log" 2>&1 || { tail -40 "$gpu_build.configure.log"; exit 1; }
cmake --build "$gpu_build" -j "$(nproc)"
