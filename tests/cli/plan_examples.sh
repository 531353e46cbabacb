#!/usr/bin/env bash
# plan_examples.sh TILLER: every GPU example config (configs/gpu/*.yaml) loads, passes the config
# check, and plans on the layout its header names ("#   tiller plan -c FILE --nodes N ...").
set -euo pipefail
tiller=$1
cd "$(dirname "$0")/../.."
n=0
for f in configs/gpu/*.yaml; do
  line=$(grep -m1 '^#   tiller plan ' "$f" | sed 's/^#   tiller plan //; s/ *#.*$//') || true
  [ -n "$line" ] || { echo "FAIL: $f names no '#   tiller plan' layout in its header" >&2; exit 1; }
  # shellcheck disable=SC2086
  out=$("$tiller" plan $line 2>&1) || { echo "FAIL: tiller plan $line:" >&2; echo "$out" >&2; exit 1; }
  grep -q "^launch:" <<< "$out" || { echo "FAIL: no launch line for $f" >&2; exit 1; }
  echo "$f: $(head -1 <<< "$out" | sed 's/^# [^:]*: //')"
  n=$((n + 1))
done
echo "$n example configs plan"
