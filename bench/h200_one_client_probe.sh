#!/bin/bash
# Issue 15, finding 1 (one client), on one H200 after .gpu/stage2.sh: is the batch-1 step's
# slow mode the host core running slower? bench/one_client.py (ours against the bare
# BatchGenerator, alternated rep by rep) and bench/step_modes.py (the bare engine in fresh
# processes), both timing a fixed pure-Python loop once per step (step_modes.cpu_probe_us):
# if the probe slows with the step, the host core is slower; if it keeps its time, MLX or the
# GPU is. The prelude records /proc/stat (steal) each second. About 5 minutes.
source "$(dirname "$0")/h200_prelude.sh"
make_llama
[ -f $Q/config.json ] || timeout 100 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1
step one-client-llama
timeout 130 python3 bench/one_client.py --model $L --reps ${REPS:-6} --json-out "$OUT/one-client-llama.json" 2>&1 \
  | grep -v Warning | tee "$OUT/one-client-llama.txt"
step step-modes-llama
timeout 110 python3 bench/step_modes.py --model $L --variants default --rounds 2 --reps 5 \
  --json-out "$OUT/step-modes-llama.json" 2>&1 | tee "$OUT/step-modes-llama.txt"
step one-client-qwen
timeout 80 python3 bench/one_client.py --model $Q --reps ${REPS:-6} --json-out "$OUT/one-client-qwen.json" 2>&1 \
  | grep -v Warning | tee "$OUT/one-client-qwen.txt"
step done
