#!/bin/bash
# Does the arrival pattern explain the gap to the engine ceiling? (one H200,
# after .gpu/stage2.sh). Concurrency 64 on the Qwen3-0.6B shape: ours with
# --admission-window-ms 0, 10 and 30 (bench/variants.sh, which ends with the
# ceiling), then the ceiling with replacements arriving 1 and 3 steps after a
# finish. On a fresh machine, put a throwaway variant first: mlx-cuda compiles
# kernels on first use (docs/performance.md).
set -u
OUT=${OUT:-/tmp/out}
SHAPE=${1:-qwen3-0.6b}
bash bench/variants.sh "$SHAPE" "warm-up::" "w0::--admission-window-ms 0" \
  "w10::--admission-window-ms 10" "w30::--admission-window-ms 30"
W="--levels 64 --requests 256 --max-tokens 128 --prompt-tokens 136"
for delay in 1 3; do
  echo "ceiling, arrival delay $delay steps: $(python3 bench/engine_ceiling.py --model /tmp/m/$SHAPE $W --arrival-delay-steps $delay 2>&1 | tail -n 1)" | tee -a "$OUT/variants.txt"
done
