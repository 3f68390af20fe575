#!/bin/bash
# Issue 15, for the next device session: where the whole server loses to its own engine core
# at 32-64 clients (third session: 0.71x the ceiling at 64 against the core's 0.97x).
# On one H200, after .gpu/stage2.sh and the .whl install (py-spy travels in .whl/ too:
# `pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 py-spy -d .whl`).
#   1. bench/engine_overhead.py, core against the server, 32 / 64 clients, three rounds: its JSON
#      splits the server's CPU per token into the API process, the engine process and the load
#      generator (api_ / engine_process_ / client_cpu_ms_per_token);
#   2. the server alone at 64 clients under bench/loadgen.py, with py-spy sampling the API
#      process and the engine process (native frames off, idle frames on: time blocked in a
#      pipe or a poll shows) for 20 s each, at the same time, and every thread's
#      /proc/PID/task/TID/schedstat (time on a CPU, time waiting for one) read each second.
# Results in $OUT. About 6 minutes with the 8B model built (make_shaped_model: ~40 s).
source "$(dirname "$0")/h200_prelude.sh"
L=${MODEL:-$L}  # MODEL, LEVELS, ROUNDS, REQUESTS, SPY: for a smoke run elsewhere
LEVELS=${LEVELS:-32,64}
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-640}
SPY=${SPY:-/tmp/site/bin/py-spy}
make_llama
step overhead
timeout 300 python3 bench/engine_overhead.py --model $L --levels $LEVELS --rounds $ROUNDS --prompt-tokens 136 \
  --max-tokens 128 --systems ceiling,core --server --json-out "$OUT/server-split.json" \
  > "$OUT/server-split.txt" 2>&1
sed -n '/^medians/,$p' "$OUT/server-split.txt"
python3 - "$OUT/server-split.json" <<'PY'
import json, sys
for level, systems in json.load(open(sys.argv[1]))["results"].items():
    for r in systems.get("server", []):
        print(level, "server cpu ms/token: api", r.get("api_cpu_ms_per_token"), "engine",
              r.get("engine_process_cpu_ms_per_token"), "client", r.get("client_cpu_ms_per_token"))
PY
step profile
PORT=8799
python3 -m api.cli --model $L --port $PORT --decode-concurrency 64 > "$OUT/server.log" 2>&1 &
API=$!
for i in $(seq 1 120); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
ENGINE=$(pgrep -P $API -f runtime.engine.process | head -1)
timeout 120 python3 bench/loadgen.py --url http://127.0.0.1:$PORT --pid $API --model $L --levels 64 \
  --requests $REQUESTS --prompt-tokens 136 --max-tokens 128 > "$OUT/profile-load.txt" 2>&1 &
LOAD=$!
sleep 25  # past the warm-up and the first prefills
for who in api:$API engine:$ENGINE; do
  name=${who%%:*} pid=${who#*:}
  timeout 40 "$SPY" record -p "$pid" -d 20 -r 200 -f raw --nonblocking --idle --threads \
    -o "$OUT/pyspy-$name.txt" > "$OUT/pyspy-$name.log" 2>&1 &
done
for i in $(seq 1 22); do
  for pid in $API $ENGINE; do
    for t in /proc/$pid/task/*; do
      echo "$(date +%s.%N) $pid ${t##*/} $(cat $t/comm 2> /dev/null) $(cat $t/schedstat 2> /dev/null)"
    done
  done
  sleep 1
done > "$OUT/schedstat.txt" 2>&1
wait $LOAD
kill -TERM $API
sleep 5
tail -n 3 "$OUT/profile-load.txt" "$OUT"/pyspy-*.log
step done
kill $SMI 2> /dev/null
