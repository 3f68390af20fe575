#!/bin/bash
# Issue 15, tenth session: MLX's CUDA caches and a long-running server, on one H200 after
# .gpu/stage2.sh and the .whl install.
#   1. bench/mlx_cache_misses.py (600 prefill-shaped attention calls, twice) with MLX's
#      defaults, with only the thrashing check off, and with the server's defaults
#      (runtime.mlx_environment);
#   2. the server of this tree and of an older tree (BEFORE, default .gpu/before) on the
#      Qwen3-0.6B shape, each given SERIAL requests one after another (default 600), every
#      prompt a different length (a new prefill shape each): how many were answered 200.
#      SERVER_ARGS (default --prompt-cache-size 0: with the cache on, each prompt extends the
#      one before, hits, and prefills only a few tokens, as in the tenth session's call e,
#      which stayed below MLX's limit) are given to both servers.
# Results in $OUT: misses-*.json, serial-*.txt. About 3 minutes.
source "$(dirname "$0")/h200_prelude.sh"
SERIAL=${SERIAL:-600}
BEFORE=${BEFORE:-.gpu/before}
step kernels
for mode in default nocheck server; do
  case $mode in
    default) env -u MLX_ENABLE_CACHE_THRASHING_CHECK timeout 120 python3 bench/mlx_cache_misses.py --json-out "$OUT/misses-$mode.json" ;;
    nocheck) MLX_ENABLE_CACHE_THRASHING_CHECK=0 timeout 120 python3 bench/mlx_cache_misses.py --json-out "$OUT/misses-$mode.json" ;;
    server) timeout 120 python3 bench/mlx_cache_misses.py --server-defaults --json-out "$OUT/misses-$mode.json" ;;
  esac 2>&1 | sed "s/^/$mode: /"
done
[ -f $Q/config.json ] || { step make-qwen; timeout 60 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1; }
serial() {  # NAME DIR PORT
  step "serial $1"
  (cd "$2" && exec python3 -m api.cli --model $Q --port $3 --log-level WARNING \
    ${SERVER_ARGS---prompt-cache-size 0}) > "$OUT/server-$1.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 90); do curl -sf localhost:$3/health > /dev/null && break; sleep 1; done
  timeout 150 python3 - "$3" "$SERIAL" > "$OUT/serial-$1.txt" 2>&1 <<'PY'
import collections, json, sys, time, urllib.request, urllib.error
port, n = int(sys.argv[1]), int(sys.argv[2])
codes, first_bad, began = collections.Counter(), None, time.time()
for i in range(n):
    body = json.dumps({"model": "default_model", "prompt": "w " * (8 + i), "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            code, text = r.status, ""
    except urllib.error.HTTPError as e:
        code, text = e.code, e.read().decode()[:300]
    except Exception as e:
        code, text = "error", repr(e)[:300]
    codes[code] += 1
    if code != 200 and first_bad is None:
        first_bad = (i, code, text)
print(f"{n} requests in {time.time() - began:.0f} s: {dict(codes)}; first not 200: {first_bad}")
PY
  cat "$OUT/serial-$1.txt"
  kill -TERM $pid; wait $pid 2> /dev/null
}
serial after . 8801
serial before "$BEFORE" 8802
step done
