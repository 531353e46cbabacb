#!/usr/bin/env bash
# plan_examples.sh TILLER [SCRATCH]: every GPU example config (configs/gpu/*.yaml) loads, passes the
# config check, and plans on the layout its header names ("#   tiller plan -c FILE --nodes N ...").
# The models' shapes (config.json alone, from tiller init-model --config-only) are written under
# SCRATCH/models, so the memory plan runs too: a header that names --gpu-memory-gb must fit it.
set -euo pipefail
tiller=$(realpath "$1")
repo=$(cd "$(dirname "$0")/../.." && pwd)
scratch=${2:-$(mktemp -d)}
mkdir -p "$scratch"
cd "$scratch"
for spec in 0.5b 1.5b 7b 32b 1.5b-rm 7b-rm; do
  size=${spec%-rm}
  flags=(--config-only)
  [ "$spec" != "$size" ] && flags+=(--value-head)
  "$tiller" init-model --preset "qwen2-$size" --out "models/qwen2.5-$spec" "${flags[@]}" > /dev/null
done
"$tiller" init-model --preset qwen3-30b-a3b-8l --out models/qwen3-30b-a3b-8l --config-only > /dev/null
n=0
for f in "$repo"/configs/gpu/*.yaml; do
  line=$(grep -m1 '^#   tiller plan ' "$f" | sed 's/^#   tiller plan //; s/ *#.*$//') || true
  [ -n "$line" ] || { echo "FAIL: $f names no '#   tiller plan' layout in its header" >&2; exit 1; }
  line=${line//configs\/gpu\//$repo/configs/gpu/}
  # shellcheck disable=SC2086
  out=$("$tiller" plan $line 2>&1) || { echo "FAIL: tiller plan $line:" >&2; echo "$out" >&2; exit 1; }
  grep -q "^launch:" <<< "$out" || { echo "FAIL: no launch line for $f" >&2; exit 1; }
  grep -q "^memory per rank" <<< "$out" || { echo "FAIL: no memory plan for $f:" >&2; echo "$out" >&2; exit 1; }
  if [[ $line == *--gpu-memory-gb* ]] && ! grep -q "  fits$" <<< "$out"; then
    echo "FAIL: $f names a GPU size but its memory plan gives no verdict:" >&2; echo "$out" >&2; exit 1
  fi
  echo "$(basename "$f"): $(head -1 <<< "$out" | sed 's/^# [^:]*: //')"
  n=$((n + 1))
done
echo "$n example configs plan"
