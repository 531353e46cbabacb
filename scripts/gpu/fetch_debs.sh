#!/usr/bin/env bash
# Run HERE (a Debian machine with network), not on the GPU host: downloads the Debian bookworm
# .deb files of what the GPU host lacks into .gpu/debs (git-ignored). Pass `.gpu` in the device
# tool's `carry`; scripts/gpu/build.sh unpacks them with dpkg -x into .gpu/prefix.
# Packages: PCRE2, utf8proc and SentencePiece (tokenizers); gRPC C++ 1.51 with what it links
# (Abseil, RE2, c-ares, OpenSSL headers) and the static protobuf of the engine service; cpp-httplib
# (the OpenAI endpoint) with brotli; zstd and xxHash (delta weight sync).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
packages=(libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
          libutf8proc-dev libutf8proc2 libsentencepiece-dev libsentencepiece0 libprotobuf-lite32
          libgrpc++-dev libgrpc-dev libgrpc++1.51 libgrpc29 protobuf-compiler-grpc libprotobuf-dev
          libabsl-dev libabsl20220623 libre2-dev libre2-9 libc-ares-dev libc-ares2 libssl-dev libssl3
          zlib1g-dev libcpp-httplib-dev libcpp-httplib0.11 libbrotli-dev libbrotli1
          libzstd-dev libzstd1 libxxhash-dev libxxhash0)
mkdir -p "$here/.gpu/debs"
cd "$here/.gpu/debs"
apt-get download "${packages[@]}"
ls -la
# The sentencepiece wheel for the host's Python (3.12), for the model tests' fixture script.
mkdir -p "$here/.gpu/wheels"
python3 -m pip download sentencepiece --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d "$here/.gpu/wheels" -q
# The openai client and what it needs, for the agent harnesses and examples/tool_use (docs/agents.md).
# The host has no network: install them there with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip download openai --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$here/.gpu/wheels" -q
