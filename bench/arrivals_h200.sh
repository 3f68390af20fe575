#!/bin/bash
# Does the arrival pattern explain the gap to the engine ceiling? (one H200,
# after .gpu/stage2.sh). Concurrency 64 on the Qwen3-0.6B shape: the ceiling
# with replacements arriving 0, 1 and 3 steps after a finish, and ours with
# --admission-window-ms 0, 10 and 30.
set -u
OUT=${OUT:-/tmp/out}
SHAPE=${1:-qwen3-0.6b}
mkdir -p /tmp/m "$OUT"
[ -f /tmp/m/$SHAPE/config.json ] || python3 bench/make_shaped_model.py "$SHAPE" /tmp/m/$SHAPE > "$OUT/make.log" 2>&1
W="--levels 64 --requests 256 --max-tokens 128 --prompt-tokens 136"
for window in 0 10 30; do
  python3 -m runtime.cli --model /tmp/m/$SHAPE --port 8400 --decode-concurrency 64 \
    --admission-window-ms $window > "$OUT/server-$window.log" 2>&1 &
  SERVER=$!
  for i in $(seq 120); do curl -sf localhost:8400/health > /dev/null && break; sleep 1; done
  echo "ours, admission window $window ms: $(python3 bench/loadgen.py --url http://127.0.0.1:8400 --pid $SERVER --model /tmp/m/$SHAPE $W 2>&1 | tail -n 1)" | tee -a "$OUT/arrivals.txt"
  curl -s localhost:8400/metrics | grep -E "engine_(busy|steps|prefill)" | grep -v TYPE | tee -a "$OUT/arrivals.txt"
  kill -TERM $SERVER; wait $SERVER
done
for delay in 0 1 3; do
  echo "ceiling, arrival delay $delay steps: $(python3 bench/engine_ceiling.py --model /tmp/m/$SHAPE $W --arrival-delay-steps $delay 2>&1 | tail -n 1)" | tee -a "$OUT/arrivals.txt"
done
