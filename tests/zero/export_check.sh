#!/bin/sh
# A sharded checkpoint, exported, loaded by transformers: its logits must be tiller's.
#   export_check.sh OUT TILLER_MPI_TESTS TILLER PYTHON CHECK_HF_LOAD_PY MPIRUN...
# 1. two ranks train a tiny model, save a sharded checkpoint and write tiller's logits
#    (ZeroExport.CheckpointForTransformers); 2. `tiller export`; 3. check_hf_load.py compares.
set -eu
out=$1 tests=$2 cli=$3 py=$4 check=$5
shift 5
rm -rf "$out"
mkdir -p "$out"
TILLER_ZERO_EXPORT_DIR="$out" "$@" -np 2 -x TILLER_ZERO_EXPORT_DIR "$tests" --gtest_filter='ZeroExport.*'
"$cli" export --checkpoint "$out/ckpt" --to "$out/hf" --dtype fp32
cp "$out/reference_logits.safetensors" "$out/hf/"
"$py" "$check" "$out"
