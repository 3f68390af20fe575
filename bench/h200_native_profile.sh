#!/bin/bash
# Issue 15, eighth session: what the server's engine process does in its long steps at 32
# clients (a wave's finishing step, its prefill steps), native frames included, against the
# bare engine under the same load. On one H200 after .gpu/stage2.sh and the .whl install.
#   1. the server at 32 clients, REQUESTS requests (default 640: twenty waves), its engine's
#      step trace ($OUT/probe*, MLX_TRIO_ENGINE_PROBE) and py-spy --native on the engine
#      process for 25 s (raw, idle frames and thread ids on);
#   2. engine_ceiling.py (mlx-lm's BatchGenerator, in-process) under the same load, py-spy
#      --native on it for 25 s.
# RATE: py-spy's samples per second (default 100; native sampling stops the process for each
# sample: at 100 Hz it halved the engine's tokens/s in the eighth session).
# Results in $OUT/profile.tgz (pyspy-{engine,ceiling}.txt, probe*, load-*.txt: one file, since
# a call returns at most eight). About 4 minutes.
source "$(dirname "$0")/h200_prelude.sh"
L=${MODEL:-$L}
LEVEL=${LEVEL:-32}
REQUESTS=${REQUESTS:-640}
SPY=${SPY:-/tmp/site/bin/py-spy}
ARGS="--prompt-tokens 136 --max-tokens 128"
make_llama
step server
PORT=8799
MLX_TRIO_ENGINE_PROBE=$OUT/probe python3 -m api.cli --model $L --port $PORT --decode-concurrency 64 \
  > "$OUT/server.log" 2>&1 &
API=$!
for i in $(seq 1 120); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
ENGINE=$(pgrep -P $API -f runtime.engine.process | head -1)
timeout 60 python3 bench/loadgen.py --url http://127.0.0.1:$PORT --model $L --levels $LEVEL \
  --requests $((LEVEL * 2)) $ARGS > "$OUT/load-warm.txt" 2>&1
timeout 150 python3 bench/loadgen.py --url http://127.0.0.1:$PORT --pid $API --model $L \
  --levels $LEVEL --requests $REQUESTS $ARGS > "$OUT/load-server.txt" 2>&1 &
LOAD=$!
sleep 8
timeout 60 "$SPY" record -p "$ENGINE" -d 25 -r ${RATE:-100} -f raw --native --idle --threads \
  -o "$OUT/pyspy-engine.txt" > "$OUT/pyspy-engine.log" 2>&1
wait $LOAD
kill -TERM $API
sleep 5
tail -n 2 "$OUT/load-server.txt" "$OUT/pyspy-engine.log"
step ceiling
timeout 170 python3 bench/engine_ceiling.py --model $L --levels $LEVEL --requests $REQUESTS \
  $ARGS > "$OUT/load-ceiling.txt" 2>&1 &
CEIL=$!
sleep 30  # past its load and warm-up
CEIL_PY=$(pgrep -P $CEIL python3 | head -1)  # $CEIL is timeout's pid, python3 its child
timeout 60 "$SPY" record -p "$CEIL_PY" -d 25 -r ${RATE:-100} -f raw --native --idle --threads \
  -o "$OUT/pyspy-ceiling.txt" > "$OUT/pyspy-ceiling.log" 2>&1
wait $CEIL
tail -n 2 "$OUT/load-ceiling.txt" "$OUT/pyspy-ceiling.log"
(cd "$OUT" && tar czf profile.tgz pyspy-* probe* load-* server.log && rm -f pyspy-* probe* load-*)
step done
