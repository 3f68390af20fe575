#!/bin/bash
# Ours under several flag sets, one after another, same workload (concurrency
# 64, 256 requests, ~136-token prompts, 128 new), then the engine ceiling:
# for A/B questions about one setting. On the H200 after .gpu/stage2.sh, or
# anywhere with MODEL=dir.
#   bash bench/variants.sh qwen3-0.6b "default::" "no-prompt-cache::--prompt-cache-size 0"
set -u
OUT=${OUT:-/tmp/out}
SHAPE=$1; shift
PY=${PY:-python3}
mkdir -p /tmp/m "$OUT"
MODEL=${MODEL:-/tmp/m/$SHAPE}
[ -f $MODEL/config.json ] || $PY bench/make_shaped_model.py "$SHAPE" $MODEL > "$OUT/make.log" 2>&1
W=${W:-"--levels 64 --requests 256 --max-tokens 128 --prompt-tokens 136"}
for variant in "$@"; do
  label=${variant%%::*}; flags=${variant#*::}
  $PY -m api.cli --model $MODEL --port 8400 --decode-concurrency 64 $flags > "$OUT/server-$label.log" 2>&1 &
  SERVER=$!
  for i in $(seq 120); do curl -sf localhost:8400/health > /dev/null && break; sleep 1; done
  echo "ours, $label ($flags): $($PY bench/loadgen.py --url http://127.0.0.1:8400 --pid $SERVER --model $MODEL $W 2>&1 | tail -n 1)" | tee -a "$OUT/variants.txt"
  curl -s localhost:8400/metrics | grep -E "^mlx_trio_(engine_(busy|steps|prefill)|prompt_cache_hit)" | tee -a "$OUT/variants.txt"
  kill -TERM $SERVER; wait $SERVER
done
echo "ceiling: $($PY bench/engine_ceiling.py --model $MODEL $W 2>&1 | tail -n 1)" | tee -a "$OUT/variants.txt"
