#!/bin/bash
# Where the engine's time goes on one H200 (after .gpu/stage2.sh): cProfile of
# mlx-trio-server's engine process and of the engine ceiling, same workload
# (random-weight Qwen3-0.6B shape, concurrency 64, ~136-token prompts, 128 new).
# Summaries land in $OUT/*.txt; read them with `python -m pstats`-style tables.
set -u
OUT=${OUT:-/tmp/out}
SHAPE=${1:-qwen3-0.6b}
mkdir -p /tmp/m "$OUT"
[ -f /tmp/m/$SHAPE/config.json ] || python3 bench/make_shaped_model.py "$SHAPE" /tmp/m/$SHAPE > "$OUT/make.log" 2>&1
W="--max-tokens 128 --prompt-tokens 136"
MLX_TRIO_ENGINE_PROFILE=/tmp/engine.prof python3 -m api.cli --model /tmp/m/$SHAPE --port 8400 \
  --decode-concurrency 64 > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 120); do curl -sf localhost:8400/health > /dev/null && break; sleep 1; done
python3 bench/loadgen.py --url http://127.0.0.1:8400 --pid $SERVER --model /tmp/m/$SHAPE --levels 64 --requests 256 $W > "$OUT/loadgen.txt" 2>&1
curl -s localhost:8400/metrics | grep "^mlx_trio_engine" | grep -v _bucket > "$OUT/metrics.txt"
kill -TERM $SERVER; wait $SERVER
python3 -m cProfile -o /tmp/ceiling.prof bench/engine_ceiling.py --model /tmp/m/$SHAPE --levels 64 --requests 256 $W > "$OUT/ceiling.txt" 2>&1
for f in /tmp/engine.prof.* /tmp/ceiling.prof; do
  python3 - "$f" > "$OUT/$(basename $f)-top.txt" <<'PY'
import pstats, sys
p = pstats.Stats(sys.argv[1])
p.sort_stats("cumulative").print_stats(45)
p.sort_stats("tottime").print_stats(35)
PY
done
tail -n 5 "$OUT/loadgen.txt" "$OUT/ceiling.txt"; cat "$OUT/metrics.txt"
