#!/bin/bash
# Issue 15, thirteenth session, after .gpu/stage2.sh: bench/compiled_decode.py (mlx-lm's decoder
# layers as built against the same layers with a compiled decode path) on both shapes, the bare
# BatchGenerator alternated rep by rep in one process on one CPU (taskset CPU, default 3).
# ROWS (default 1,8,32,64), REPS (default 6). Results: $OUT/compiled-{qwen,llama}.{txt,json}.
source "$(dirname "$0")/h200_prelude.sh"
[ -f $Q/config.json ] || { step make-qwen; timeout 60 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1; }
step qwen
timeout ${LIMIT:-200} taskset -c ${CPU:-3} python3 bench/compiled_decode.py --model $Q --rows ${ROWS:-1,8,32,64} \
  --reps ${REPS:-6} --json-out "$OUT/compiled-qwen.json" > "$OUT/compiled-qwen.txt" 2>&1
cat "$OUT/compiled-qwen.txt"
make_llama
step llama
timeout ${LIMIT:-200} taskset -c ${CPU:-3} python3 bench/compiled_decode.py --model $L --rows ${ROWS:-1,8,32,64} \
  --reps ${REPS:-6} --json-out "$OUT/compiled-llama.json" > "$OUT/compiled-llama.txt" 2>&1
cat "$OUT/compiled-llama.txt"
step done
