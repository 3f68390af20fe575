#!/bin/bash
# Issue 15 re-measure on one H200 (after .gpu/stage2.sh, PYTHONPATH=/tmp/site:$PWD), in two
# device calls that fit the 10-minute limit (PART=a, then PART=b on the same warm machine):
#   a: Llama-3-8B shape: bench/engine_overhead.py at 32 / 64 clients (bare BatchGenerator,
#      our EngineCore, EngineCore with prompt-cache entries stored as before the fix, and the
#      whole server over HTTP), then side_by_side greedy at 8 / 32 / 64 (ceiling vs ours);
#   b: Llama-3-8B shape sampled (0.7 / 0.9, varied per request) at 8 / 32 / 64, one client
#      (ours vs bare, alternated), then the Qwen3-0.6B shape: one client and greedy 8 / 32 / 64.
# nvidia-smi samples the clocks (read only). Results in $OUT.
source "$(dirname "$0")/h200_prelude.sh"
W="--max-tokens 128 --prompt-tokens 136 --rounds 1 --only engine,ours --no-plot"
make_llama
if [ "$PART" = a ]; then
  step engine-overhead
  timeout 280 python3 bench/engine_overhead.py --model $L --levels 32,64 --rounds 2 --prompt-tokens 136 \
    --max-tokens 128 --systems ceiling,core,core-lazy --server --json-out "$OUT/overhead-llama.json" \
    > "$OUT/overhead-llama.txt" 2>&1
  tail -n 30 "$OUT/overhead-llama.txt"
  step greedy-llama
  timeout 200 python3 bench/side_by_side.py --model $L --levels 8,32,64 $W --results-dir "$OUT/greedy-llama" \
    > "$OUT/greedy-llama.txt" 2>&1
  tail -n 12 "$OUT/greedy-llama.txt"
else
  step sampled-llama
  timeout 215 python3 bench/side_by_side.py --model $L --levels 32,64 $W --temperature 0.7 --top-p 0.9 \
    --mixed-sampling --results-dir "$OUT/sampled-llama" > "$OUT/sampled-llama.txt" 2>&1
  tail -n 12 "$OUT/sampled-llama.txt"
  step one-client-llama
  timeout 110 python3 bench/one_client.py --model $L --reps 6 --json-out "$OUT/one-client-llama.json" 2>&1 \
    | tee "$OUT/one-client-llama.txt"
  step make-qwen
  [ -f $Q/config.json ] || timeout 60 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1
  step one-client-qwen
  timeout 60 python3 bench/one_client.py --model $Q --reps 6 --json-out "$OUT/one-client-qwen.json" 2>&1 \
    | tee "$OUT/one-client-qwen.txt"
  step greedy-qwen
  timeout 100 python3 bench/side_by_side.py --model $Q --levels 8,64 $W --results-dir "$OUT/greedy-qwen" \
    > "$OUT/greedy-qwen.txt" 2>&1
  tail -n 12 "$OUT/greedy-qwen.txt"
fi
step done
kill $SMI
