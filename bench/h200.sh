#!/bin/bash
# Issue 5 on one H200 (device kind nvidia-h200), after .gpu/stage2.sh
# (PYTHONPATH=/tmp/site:$PWD): one side-by-side run per shape, on random-weight
# bf16 models shaped like Qwen3-0.6B and Llama-3-8B: the engine ceiling,
# mlx_lm.server, ours (engine process, the default) and ours with
# --engine-mode thread (ONLY=engine,ref,ours,ours-thread), levels 1/8/32/64, prompts of ~136 tokens, 128 new.
#   bash bench/h200.sh qwen3-0.6b [llama3-8b ...]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/m "$OUT"
for shape in "$@"; do
  [ -f /tmp/m/$shape/config.json ] || python3 bench/make_shaped_model.py "$shape" /tmp/m/$shape > "$OUT/make-$shape.log" 2>&1
  python3 bench/side_by_side.py --model /tmp/m/$shape --levels 1,8,32,64 --rounds 1 \
    --only ${ONLY:-engine,ref,ours} --max-tokens 128 --prompt-tokens 136 \
    --results-dir "$OUT/$shape" --no-plot > "$OUT/$shape.txt" 2>&1
  tail -n 14 "$OUT/$shape.txt"
done
# The device returns at most a few files per call: pack the rest into one.
tar czf "$OUT/results-$(date +%H%M%S).tgz" -C "$OUT" --exclude '*.tgz' . 2>/dev/null
find "$OUT" -mindepth 1 ! -name '*.tgz' ! -name '*.txt' -delete
