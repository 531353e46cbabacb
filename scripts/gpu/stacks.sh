#!/usr/bin/env bash
# Prints every thread's stack of every running `tiller` process (the debugger attaches briefly; the
# process goes on afterwards). For a job that makes no progress: which rank waits where.
#   scripts/gpu/stacks.sh > stacks.txt
# gdb, or where the host has none (the GPU hosts of docs/gpu.md) CUDA's cuda-gdb, which debugs host
# code as gdb does.
set -uo pipefail
debugger=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null) ||
  { echo "stacks.sh: neither gdb nor cuda-gdb is installed" >&2; exit 2; }
# Every process at once: cuda-gdb takes minutes over one CUDA process (on 2026-11-28 it spent the
# whole wait on the controller), so a rank at a time would not reach the trainers.
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
pids=$(pgrep -x tiller)
for pid in $pids; do
  timeout "${STACKS_TIMEOUT_S:-240}" "$debugger" -p "$pid" -batch -nx -ex "set pagination off" \
    -ex "thread apply all bt 25" > "$tmp/$pid" 2>/dev/null &
done
wait
for pid in $pids; do
  rank=$(tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
  echo "=== rank ${rank:-?} (pid $pid): $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-200)"
  grep -E '^(Thread|#)' "$tmp/$pid" | sed -E 's/ \(.*\) at / at /' | cut -c1-220
done
