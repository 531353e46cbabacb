#!/usr/bin/env bash
# run.sh BUILD_DIR WORK_DIR PREFIX_PATH CMAKE: installs the tiller build into WORK_DIR/prefix,
# then configures, builds and runs tests/install/consumer against it (find_package(Tiller)),
# as a user who links tiller into a trainer would.
set -euo pipefail
build=$1; work=$2; prefix_path=$3; cmake=$4
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"; mkdir -p "$work"
"$cmake" --install "$build" --prefix "$work/prefix" > "$work/install.log"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
"$cmake" -S "$here/consumer" -B "$work/build" -G Ninja "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$work/prefix;$prefix_path" > "$work/configure.log"
"$cmake" --build "$work/build" > "$work/build.log"
"$work/build/consumer" "$here/../../configs/quickstart.yaml"
# The installed CLI works too.
"$work/prefix/bin/tiller" --version
