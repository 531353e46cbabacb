#!/usr/bin/env bash
# run.sh MODE BUILD_DIR WORK_DIR PREFIX_PATH CMAKE [MPIRUN]: installs the tiller build into
# WORK_DIR/prefix, then, as a user who links tiller into a trainer would (find_package(Tiller)):
#   consumer        builds tests/install/consumer and runs it, then the installed CLI
#   custom_trainer  builds examples/custom_trainer, trains the quickstart with its own reward
#                   (reward.rule=label_digits), advantage estimator (clipped_gae), policy loss
#                   (cispo), step hook (best_reward) and prompt source (digit_tasks: generated
#                   prompts, not the file) under mpirun and checks the reward rises
#                   (below 0.15 in steps 1-3, above 0.3 in steps 28-30) and the hook's metric and
#                   file; then 3 steps with its sample loop (revise: a draft, a hint, a revision)
#                   whose samples have two turns and the hint's tokens masked; the stock tiller
#                   binary must refuse each name (only the example registers them)
set -euo pipefail
mode=$1; build=$2; work=$3; prefix_path=$4; cmake=$5; mpirun=${6:-mpirun}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
rm -rf "$work"; mkdir -p "$work"
"$cmake" --install "$build" --prefix "$work/prefix" > "$work/install.log"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
case "$mode" in
  consumer) src="$here/consumer" ;;
  custom_trainer) src="$repo/examples/custom_trainer" ;;
  *) echo "run.sh: unknown mode '$mode' (consumer or custom_trainer)" >&2; exit 2 ;;
esac
"$cmake" -S "$src" -B "$work/build" -G Ninja "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$work/prefix;$prefix_path" > "$work/configure.log"
"$cmake" --build "$work/build" > "$work/build.log"

if [ "$mode" = consumer ]; then
  "$work/build/consumer" "$repo/configs/quickstart.yaml"
  "$work/prefix/bin/tiller" --version  # the installed CLI works too
  exit 0
fi

python3 "$repo/scripts/make_quickstart.py" "$work/model" "$work/prompts.jsonl" > /dev/null 2>&1
sets=(--set "roles.actor.model=$work/model" --set "roles.critic.model=$work/model"
      --set "data.prompts=$work/prompts.jsonl" --set "run.output_dir=$work/out"
      --set "checkpoint.dir=$work/out/checkpoints" --set reward.rule=label_digits
      --set "eval.prompts=$work/eval.jsonl" --set engines.kv_cache_gb=0.0625)  # 64 MiB: see check_train.py
run() {  # BINARY [--set ...]
  local bin=$1; shift
  "$mpirun" --oversubscribe --allow-run-as-root -np 4 "$bin" train -c "$repo/configs/quickstart.yaml" "${sets[@]}" "$@"
}
stock_refuses() {  # WHAT: the stock tiller fails, naming WHAT
  if run "$work/prefix/bin/tiller" "${@:2}" > "$work/stock.log" 2>&1; then
    echo "FAIL: the stock tiller accepted $1" >&2; exit 1
  fi
  grep -q "$1" "$work/stock.log" || { echo "FAIL: the stock tiller's error does not name $1:" >&2; tail -5 "$work/stock.log" >&2; exit 1; }
  echo "stock tiller: $(grep -m1 'tiller: error' "$work/stock.log")"
}
stock_refuses clipped_gae --set algo.advantage_estimator=clipped_gae
stock_refuses cispo --set algo.policy_loss=cispo
stock_refuses best_reward --set train.step_hooks=best_reward
stock_refuses digit_tasks --set data.source=digit_tasks
stock_refuses label_digits
stock_refuses "'revise': not a registered sample loop" --set rollout.loop=revise
sets+=(--set algo.advantage_estimator=clipped_gae --set algo.policy_loss=cispo --set train.step_hooks=best_reward
       --set data.source=digit_tasks)
# The names reach the job only through the example's registrations (the stock binary refused them
# above), so a run that trains is a run with them.
run "$work/build/custom_trainer" > "$work/train.log" 2>&1 || { tail -40 "$work/train.log" >&2; exit 1; }
python3 - "$work/out/metrics.jsonl" "$work/out/checkpoints" <<'PY'
import glob, json, os, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
lines = [m for m in lines if m["step"] >= 1]  # the step-0 row is the evaluation before training
rewards = [m["reward/mean"] for m in lines]
# The step hook: the running best of reward/mean, as a metric and beside the last checkpoint.
best = [m.get("custom/best_reward_mean") for m in lines]
if any(b is None or abs(b - max(rewards[:i + 1])) > 1e-5 for i, b in enumerate(best)):
    sys.exit(f"FAIL: custom/best_reward_mean {best} is not the running best of {rewards}")
last_ckpt = sorted(glob.glob(os.path.join(sys.argv[2], "step_*")))[-1]
saved = json.load(open(os.path.join(last_ckpt, "custom_trainer.json")))
if saved["step"] != len(rewards) or abs(saved["best_reward_mean"] - max(rewards)) > 1e-5:
    sys.exit(f"FAIL: {last_ckpt}/custom_trainer.json says {saved}; best {max(rewards)} at step {len(rewards)}")
if not all("actor/clip_fraction" in m for m in lines):
    sys.exit("FAIL: a step without actor/clip_fraction (the registered policy loss's statistic)")
# The policy loss's own metric: its clipped importance weight's mean, within the clip range.
weights = [m.get("actor/policy_loss/weight_mean") for m in lines]
if any(w is None or not 0.8 - 1e-6 <= w <= 1.2 + 1e-6 for w in weights):
    sys.exit(f"FAIL: actor/policy_loss/weight_mean {weights} is missing or outside the clip range")
first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
print(f"custom_trainer: label_digits reward {first:.3f} (steps 1-3) -> {last:.3f} (steps {len(rewards) - 2}-{len(rewards)})")
if len(rewards) != 30 or not (first < 0.15 and last > 0.3):
    sys.exit(f"FAIL: the custom reward did not rise clearly: {[round(r, 3) for r in rewards]}")
PY

# The sample loop: 3 steps of the two-turn agent. Its samples have two model turns with the hint's
# tokens between them, masked.
run "$work/build/custom_trainer" --set rollout.loop=revise --set 'rollout.loop_args=" digits please"' --set train.num_steps=3 \
  --set "run.output_dir=$work/loop" --set checkpoint.dir= > "$work/loop.log" 2>&1 || { tail -40 "$work/loop.log" >&2; exit 1; }
python3 - "$work/loop/metrics.jsonl" <<'PY'
import json, sys
lines = [m for m in (json.loads(l) for l in open(sys.argv[1])) if m["step"] >= 1]
turns = [m.get("turns/mean") for m in lines]
hint = [m.get("tokens/observation") for m in lines]
print(f"custom_trainer: revise loop turns/mean {turns}, hint tokens {hint}")
if len(lines) != 3 or any(t != 2 for t in turns) or any(h is None or h <= 0 for h in hint):
    sys.exit(f"FAIL: the revise loop's samples are not two turns with masked hint tokens: {turns} {hint}")
PY
