#!/bin/bash
# Issue 15 on one H200 (after .gpu/stage2.sh, PYTHONPATH=/tmp/site:$PWD), Llama-3-8B shape:
#   1. one client: ours vs the bare BatchGenerator, alternated rep by rep (bench/one_client.py),
#      with the GPU's clocks and power sampled every 200 ms (nvidia-smi, read only);
#   2. 32 and 64 clients, greedy: engine ceiling vs ours (side_by_side, warm);
#   3. the same with temperature 0.7 / top_p 0.9, varied request by request, against a
#      ceiling with the same sampling.
# Results in $OUT (packed into one archive).
set -u
OUT=${OUT:-/tmp/out}
M=/tmp/m/llama3-8b
mkdir -p /tmp/m "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,pstate \
  --format=csv -lms 200 > "$OUT/smi.csv" 2>&1 &
SMI=$!
[ -f $M/config.json ] || timeout 150 python3 bench/make_shaped_model.py llama3-8b $M > "$OUT/make.log" 2>&1
echo "== one client $(date +%T)"
timeout 170 python3 bench/one_client.py --model $M --reps ${REPS:-6} --json-out "$OUT/one-client.json" 2>&1 | tee "$OUT/one-client.txt"
W="--max-tokens 128 --prompt-tokens 136 --rounds 1 --only engine,ours --no-plot"
echo "== greedy $(date +%T)"
timeout 200 python3 bench/side_by_side.py --model $M --levels ${LEVELS:-32,64} $W --results-dir "$OUT/greedy" > "$OUT/greedy.txt" 2>&1
tail -n 12 "$OUT/greedy.txt"
echo "== sampled $(date +%T)"
timeout 200 python3 bench/side_by_side.py --model $M --levels ${LEVELS:-32,64} $W --temperature 0.7 --top-p 0.9 \
  --mixed-sampling --results-dir "$OUT/sampled" > "$OUT/sampled.txt" 2>&1
tail -n 12 "$OUT/sampled.txt"
kill $SMI
tar czf "$OUT/results-$(date +%H%M%S).tgz" -C "$OUT" --exclude '*.tgz' . 2>/dev/null
find "$OUT" -mindepth 1 ! -name '*.tgz' ! -name '*.txt' -delete
