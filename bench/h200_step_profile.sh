#!/bin/bash
# Issue 15, 32 clients: where a decode step's time goes, the bare engine against our server's
# engine, on one H200 after .gpu/stage2.sh and the .whl install (py-spy travels in .whl/).
#   1. the engine ceiling, then our engine core, in-process (bench/engine_overhead.py --systems
#      ceiling / core, the main thread on CPU 3) under 32 clients, py-spy sampling that process
#      for 15 s each (idle frames on: time blocked in mx.eval, waiting for the GPU, shows as
#      its line);
#   2. the server (its engine loop on CPU 3, the API process elsewhere) under
#      bench/loadgen.py at 32 clients, py-spy sampling its engine process for 15 s; the engine
#      also logs its steps (MLX_TRIO_ENGINE_PROBE, runtime.engine.host_speed).
# Both also write a per-step trace. Results: $OUT/step-profile.tgz. About 5 minutes.
source "$(dirname "$0")/h200_prelude.sh"
L=${MODEL:-$L}  # MODEL, SPY, CPU, REQUESTS: for a smoke run elsewhere
REQUESTS=${REQUESTS:-480}
SPY=${SPY:-/tmp/site/bin/py-spy}
CPU=${CPU:-3}
others=$(python3 -c "import os; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0) - {$CPU})))")
work=/tmp/step-profile
rm -rf $work && mkdir -p $work
[ -n "${MODEL:-}" ] || make_llama
spy() {  # spy NAME PID: 15 s of py-spy on PID
  timeout 30 "$SPY" record -p "$2" -d 15 -r 200 -f raw --nonblocking --idle --threads \
    -o "$work/pyspy-$1.txt" > "$work/pyspy-$1.log" 2>&1
}
for system in ceiling core; do
  step $system
  python3 bench/engine_overhead.py --model $L --levels 32 --rounds 1 --requests $REQUESTS \
    --prompt-tokens 136 --max-tokens 128 --systems $system --engine-cpu $CPU --trace $work/trace \
    > $work/$system.txt 2>&1 &
  BENCH=$!
  for i in $(seq 1 120); do grep -q "^conc system" $work/$system.txt 2> /dev/null && break; sleep 1; done
  sleep 4
  spy $system $BENCH
  wait $BENCH
  grep "^  32" $work/$system.txt
done
step server
PORT=8799
MLX_TRIO_ENGINE_PROBE=$work/probe taskset -c $others python3 -m api.cli --model $L --port $PORT \
  --decode-concurrency 64 > $work/server.log 2>&1 &
API=$!
for i in $(seq 1 120); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
ENGINE=$(pgrep -P $API -f runtime.engine.process | head -1)
taskset -c -p $CPU $ENGINE > /dev/null  # its main thread (the engine loop), as in-process
taskset -c $others python3 bench/loadgen.py --url http://127.0.0.1:$PORT --model $L --levels 32 \
  --requests $REQUESTS --prompt-tokens 136 --max-tokens 128 > $work/load.txt 2>&1 &
LOAD=$!
sleep 20  # the warm-up pass and the first waves
spy engine $ENGINE
wait $LOAD
tail -n 1 $work/load.txt
kill -TERM $API
sleep 3
tar czf "$OUT/step-profile.tgz" -C /tmp step-profile
step done
