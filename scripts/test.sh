#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh, idempotent), then runs every test label: unit, mpi, e2e,
# and gpu (which skips cleanly without GPUs). Extra arguments go to ctest, e.g. -L unit.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)
bash "$here/scripts/setup.sh"
built=$(date +%s)
echo "setup + build: $((built - start)) s"
# MPI as root (CI containers) and more ranks than cores need these; harmless elsewhere.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# MKL's reproducible mode in the test executables too (tiller sets it itself; apps/tiller/run_main.cpp).
export MKL_CBWR=${MKL_CBWR:-AUTO}
rc=0
ctest --test-dir "$here/build" -j2 --output-on-failure --timeout 900 "$@" || rc=$?
echo "tests: $(( $(date +%s) - built )) s"
# Last, so that a log cut to its tail still says why each failing test failed.
if [ "$rc" -ne 0 ]; then python3 "$here/scripts/failed_tests.py" "$here/build" || true; fi
exit "$rc"
