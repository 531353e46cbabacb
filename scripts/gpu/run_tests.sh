#!/usr/bin/env bash
# On the GPU host: builds (scripts/gpu/build.sh) and runs every test, the gpu label included.
# Extra arguments go to ctest (e.g. -L gpu).
set -euo pipefail
source "$(dirname "$0")/env.sh"
bash "$tiller_root/scripts/gpu/build.sh"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
ctest --test-dir "$gpu_build" -j 4 --output-on-failure --timeout 600 "$@"
