#!/bin/bash
# Issue 15, many clients, on one H200 after .gpu/stage2.sh: the engine ceiling, our engine
# core and the whole server with every engine on the same CPU (engine_overhead.py
# --engine-cpu; the server's API process and the load generator on the other CPUs), so that
# the vCPUs' different speeds (bench/h200_one_client_probe.sh) do not decide the comparison.
# VARIANTS: more servers, each "NAME[@DIR][:ARGS]" (engine_overhead.py --server-variant),
# separated by ";" — e.g. an older build extracted to /tmp/before, or other flags.
# SYSTEMS: the in-process ones (default ceiling,core). Each engine keeps its peak MLX memory
# (about 37 GB on the 8B shape at 64 clients): four engines in all are at the GPU's limit (one
# run of four failed, runs of five did): the last server to run at 64 then fails its requests.
# TRACE=1: each run's engine steps and arrivals in $OUT/trace/ (engine_overhead.py --trace).
# SHAPE=qwen3-0.6b: the Qwen3-0.6B shape instead of Llama-3-8B.
# EXTRA: more engine_overhead.py arguments (e.g. the in-process arrivals: --first-wave-ms 80
# --arrival-delay-ms 10 --arrival-jitter-ms 40). JSON=NAME: $OUT/NAME.{txt,json} (default pinned).
# About 5 minutes with the 8B model built (three systems). Results: $OUT/pinned.{txt,json}.
source "$(dirname "$0")/h200_prelude.sh"
if [ "${SHAPE:-llama3-8b}" = qwen3-0.6b ]; then  # SHAPE=qwen3-0.6b: the small shape
  [ -f $Q/config.json ] || { step make-qwen; timeout 60 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1; }
  L=$Q
else
  make_llama
fi
step pinned
variants=()
IFS=';' read -ra specs <<< "${VARIANTS:-}"
for spec in "${specs[@]}"; do [ -n "$spec" ] && variants+=(--server-variant "$spec"); done
timeout ${LIMIT:-420} python3 bench/engine_overhead.py --model $L --levels ${LEVELS:-8,32,64} --rounds ${ROUNDS:-3} \
  --prompt-tokens 136 --max-tokens 128 --systems ${SYSTEMS:-ceiling,core} --server "${variants[@]}" --engine-cpu ${CPU:-3} \
  --json-out "$OUT/${JSON:-pinned}.json" ${TRACE:+--trace "$OUT/trace"} ${EXTRA:-} \
  > "$OUT/${JSON:-pinned}.txt" 2>&1
sed -n '/^medians/,$p' "$OUT/${JSON:-pinned}.txt"
python3 bench/like_for_like.py "$OUT/${JSON:-pinned}.json" 2> /dev/null  # ratios at like host speed
step done
