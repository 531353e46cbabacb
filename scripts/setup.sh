#!/usr/bin/env bash
# Sets up a Debian bookworm machine for tiller's CPU build and builds it. Idempotent: each step
# checks what is already there. Usage: scripts/setup.sh [--deps-only] [--build-dir DIR]
#
# Installs: Debian packages (toolchain, Open MPI, gRPC/protobuf, spdlog, CLI11, yaml-cpp,
# nlohmann-json, GoogleTest, SentencePiece, PCRE2, Python's development files), the CPU libtorch
# from the pinned PyTorch wheel (never an unpinned torch: that pulls GB of CUDA packages), and the
# Python packages that the compatibility tests use (and pyarrow, which parquet prompts need at run
# time). Then configures and builds with CMake + Ninja + ccache, embedding the same Python that
# has those packages (reward.type: python runs in it).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
build_dir="$here/build"
deps_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --deps-only) deps_only=1 ;;
    --build-dir) build_dir=$2; shift ;;
    *) echo "setup.sh: unknown argument '$1' (use --deps-only or --build-dir DIR)" >&2; exit 2 ;;
  esac
  shift
done

apt_packages=(
  build-essential cmake ninja-build ccache pkg-config git
  openmpi-bin libopenmpi-dev
  libspdlog-dev libfmt-dev libcli11-dev libyaml-cpp-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libsentencepiece-dev libpcre2-dev libutf8proc-dev
  libzstd-dev libxxhash-dev
  libcpp-httplib-dev
  python3-dev
  openssl
)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

python=${PYTHON:-python3}
# The pinned CPU wheel; the version is checked, not just the import, so a stray CUDA torch is noticed.
if ! $python -c 'import torch,sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU wheel)"
  $python -m pip install -q torch==2.13.0
fi
# Python side of the tests. torch is already satisfied, so nothing here may pull another torch.
# jinja2 (>= 3.1.6, the sandbox fixes transformers asks for) renders models' chat templates in the
# embedded interpreter at run time (src/python/jinja.cpp); torch depends on it too. wandb and
# mlflow-skinny (MLflow's client without its server) are the trackers logging.wandb and
# logging.mlflow drive (src/python/tracking.cpp; e2e.train.tracking runs both offline). math-verify
# compares MATH answers for examples/rewards/math_equiv.py (e2e.data.recipes). huggingface_hub
# downloads models named by hub id into the HF cache (src/python/hub_download.cpp; e2e.train.hub);
# transformers depends on it too. openai is the client e2e.engine.openai drives the engine's
# OpenAI-compatible endpoint with (what agent harnesses use).
py_packages=(transformers tokenizers safetensors sentencepiece grpcio grpcio-tools numpy tensorboard pyarrow peft==0.21.2
             "jinja2>=3.1.6" wandb mlflow-skinny math-verify huggingface_hub openai)
if ! $python -c 'import transformers, tokenizers, safetensors, sentencepiece, grpc, grpc_tools, numpy, tensorboard, pyarrow, peft, jinja2, wandb, mlflow, math_verify, huggingface_hub, openai' 2>/dev/null; then
  echo "setup: installing Python test packages: ${py_packages[*]}"
  $python -m pip install -q "${py_packages[@]}" "torch==2.13.0"
fi

[ "$deps_only" -eq 1 ] && exit 0

torch_prefix=$($python -c 'import torch; print(torch.utils.cmake_prefix_path)')
python_exe=$($python -c 'import sys; print(sys.executable)')
# Debug info as line tables only (-g1): backtraces and addr2line keep each frame's file and line,
# and the torch-heavy files compile about 40% faster than with full debug info (attention.cpp:
# 25 s with -g, 15 s with -g1, 2026-11-26), which is most of CI's time.
cmake -S "$here" -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DTILLER_PYTHON=ON -DPython3_EXECUTABLE="$python_exe" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="env;CCACHE_SLOPPINESS=pch_defines,time_macros;ccache"
cmake --build "$build_dir"
