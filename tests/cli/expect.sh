#!/usr/bin/env bash
# expect.sh CODE REGEX CMD...: runs CMD; passes if it exits with CODE and its combined
# stdout+stderr matches the extended REGEX (grep -Ez: the whole output is one record).
set -u
want=$1; re=$2; shift 2
out=$("$@" 2>&1); got=$?
printf '%s\n' "$out"
if [ "$got" -ne "$want" ]; then echo "expect.sh: exit code $got, expected $want" >&2; exit 1; fi
if ! printf '%s' "$out" | grep -Ezq -- "$re"; then echo "expect.sh: output does not match: $re" >&2; exit 1; fi
