#!/usr/bin/env bash
# Sets up this machine (scripts/setup.sh: packages, pinned CPU torch, build), makes the tiny model
# and the prompts (scripts/make_quickstart.py), then runs the CPU quickstart: PPO with a critic on
# the toy task, 4 ranks under mpirun (controller, actor + reference, critic, engine). The reward
# climbs from ~0.03 to ~0.9 in 30 steps; metrics land in out/quickstart/ (metrics.jsonl and
# tensorboard/), checkpoints in out/quickstart/checkpoints/.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bash "$here/scripts/setup.sh"
cd "$here"
python3 scripts/make_quickstart.py
root_flag=()
[ "$(id -u)" -eq 0 ] && root_flag=(--allow-run-as-root)
mpirun --oversubscribe "${root_flag[@]}" -np 4 build/bin/tiller train -c configs/quickstart.yaml \
  --set checkpoint.resume=false "$@"
