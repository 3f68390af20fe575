#!/bin/bash
# Issue 15, third device session, on one H200 (after .gpu/stage2.sh, PYTHONPATH=/tmp/site:$PWD),
# in three device calls that each fit the 10-minute limit (PART=greedy, sampled, qwen, on the
# same warm machine). Everything is bench/engine_overhead.py (no per-level warm-up pass), three
# alternated rounds:
#   greedy:  Llama-3-8B shape at 8 / 32 / 64 clients: the bare BatchGenerator, our EngineCore
#            (prompt-cache entries' copies started once per step), EngineCore as before
#            (core-each: one evaluation per entry), and the whole server over HTTP;
#   sampled: the same shape, temperature 0.7 / top-p 0.9 varied request by request
#            (--mixed-sampling), the ceiling with one shared mlx-lm sampler per parameter set;
#            then one client (ours vs bare, alternated);
#   qwen:    the Qwen3-0.6B shape, greedy 8 / 32 / 64, then one client.
# nvidia-smi samples the clocks (read only). Results in $OUT.
source "$(dirname "$0")/h200_prelude.sh"
W="--prompt-tokens 136 --max-tokens 128 --rounds 3"
overhead() {  # name, budget s, args...
  local name=$1 budget=$2
  shift 2
  step "$name"
  timeout "$budget" python3 bench/engine_overhead.py $W --json-out "$OUT/$name.json" "$@" \
    > "$OUT/$name.txt" 2>&1
  sed -n '/^conc system/,$p' "$OUT/$name.txt" | tail -n 40
}
case "$PART" in
  greedy)
    make_llama
    overhead greedy-llama 420 --model $L --levels 8,32,64 --systems ceiling,core,core-each --server
    ;;
  sampled)
    overhead sampled-llama 330 --model $L --levels 8,32,64 --systems ceiling,core --server \
      --temperature 0.7 --top-p 0.9 --mixed-sampling
    step one-client-llama
    timeout 100 python3 bench/one_client.py --model $L --reps 6 --json-out "$OUT/one-client-llama.json" 2>&1 \
      | tee "$OUT/one-client-llama.txt" | tail -n 12
    ;;
  qwen)
    step make-qwen
    [ -f $Q/config.json ] || timeout 90 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1
    overhead greedy-qwen 300 --model $Q --levels 8,32,64 --systems ceiling,core --server
    step one-client-qwen
    timeout 80 python3 bench/one_client.py --model $Q --reps 6 --json-out "$OUT/one-client-qwen.json" 2>&1 \
      | tee "$OUT/one-client-qwen.txt" | tail -n 12
    ;;
esac
step done
kill $SMI
