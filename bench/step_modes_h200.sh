#!/bin/bash
# Issue 15, finding 1, on one H200 (after .gpu/stage2.sh, PYTHONPATH=/tmp/site):
# the bare BatchGenerator's batch-1 step time, 5 reps per fresh process, under
# variants (CUDA graphs off, one CUDA graph per step, gc off), alternating, on
# the Llama-3-8B and Qwen3-0.6B shapes. Results: $OUT/step-modes-*.{txt,json}.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/m "$OUT"
for shape in llama3-8b qwen3-0.6b; do
  [ -f /tmp/m/$shape/config.json ] || python3 bench/make_shaped_model.py "$shape" /tmp/m/$shape > "$OUT/make-$shape.log" 2>&1
done
python3 bench/step_modes.py --model /tmp/m/llama3-8b --variants default,one-graph,no-graphs,gc-off \
  --rounds 2 --reps 5 --json-out "$OUT/step-modes-llama3-8b.json" 2>&1 | tee "$OUT/step-modes-llama3-8b.txt"
python3 bench/step_modes.py --model /tmp/m/qwen3-0.6b --variants default,one-graph,no-graphs,gc-off \
  --rounds 1 --reps 5 --json-out "$OUT/step-modes-qwen3-0.6b.json" 2>&1 | tee "$OUT/step-modes-qwen3-0.6b.txt"
