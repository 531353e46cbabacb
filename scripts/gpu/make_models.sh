#!/usr/bin/env bash
# Writes randomly initialised HF checkpoints of the example configs' shapes (configs/gpu/) into
# models/: models/qwen2.5-SIZE and, with -rm, a value-head reward model models/qwen2.5-SIZE-rm,
# with -128k the shape with Qwen2.5's YaRN scaling by 4 (128k positions: the long-sample configs),
# with the quickstart's tokenizer, its vocabulary padded to the model's own (scripts/pad_tokenizer.py: 151936 for 0.5B,
# 1.5B and the Qwen3 shapes, 152064 above), so that every sampled id decodes and `tiller generate` accepts the pair.
# Skips what exists. For timing runs: real training points roles.*.model at real checkpoints.
#   scripts/gpu/make_models.sh 0.5b 1.5b 1.5b-rm 7b
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$tiller_root"
[ -f models/tiny-qwen2/tokenizer.json ] || $python scripts/make_quickstart.py > /dev/null
# The quickstart's BPE, its vocabulary padded to a preset's size.
tokenizer_for() {  # vocab -> directory
  local dir=models/qwen2.5-tokenizer-$1
  [ -f $dir/tokenizer.json ] || $python scripts/pad_tokenizer.py models/tiny-qwen2 $dir $1 > /dev/null
  echo $dir
}
device=cpu
nvidia-smi -L > /dev/null 2>&1 && device=cuda
for spec in "$@"; do
  size=${spec%-rm}
  extra=()
  if [ "${size%-128k}" != "$size" ]; then size=${size%-128k}; extra+=(--rope-yarn 4); fi
  case "$size" in
    0.5b|1.5b) preset=qwen2-$size out=models/qwen2.5-$spec vocab=151936 ;;
    7b|32b|72b) preset=qwen2-$size out=models/qwen2.5-$spec vocab=152064 ;;
    qwen3-30b-a3b-8l) preset=$size out=models/$spec vocab=151936 ;;  # a mixture of experts (configs/gpu/qwen3-30b-a3b-8l-*)
    *) echo "make_models.sh: unknown size '$spec' (0.5b, 1.5b, 7b, 32b, 72b, qwen3-30b-a3b-8l, with -rm for a reward model, -128k for 128k positions)" >&2
       exit 2 ;;
  esac
  [ -f "$out/config.json" ] && continue
  [ "${spec%-rm}" != "$spec" ] && extra+=(--value-head --seed 7)
  # Drawn on the GPU when there is one: the host draws serially (5.5 minutes for the 32B shape).
  "$gpu_build/bin/tiller" init-model --preset "$preset" --out "$out" --dtype bf16 --device "$device" \
    --tokenizer-from "$(tokenizer_for $vocab)" \
    "${extra[@]}"
done
