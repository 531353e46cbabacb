#!/usr/bin/env bash
# Sets up this machine (scripts/setup.sh: packages, pinned CPU torch, build), then runs the main
# job. Until the PPO loop lands, the main job is the rank plan of the CPU quickstart config.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bash "$here/scripts/setup.sh"
"$here/build/bin/tiller" plan -c "$here/configs/quickstart.yaml" --nodes 1 --gpus-per-node 4
