#!/bin/bash
# Issue 15, fourteenth session, after .gpu/stage2.sh: bench/new_batch_sizes.py on both shapes,
# each variant (stock: mlx-lm's layers; lazy: the compiled path traced at each size's first
# step; traced: every size traced up front, as the server does at load) in its own process on
# CPU ${CPU:-3}, batch sizes ${SIZES:-1-64} in order. SHAPES (default "qwen llama").
# Results: $OUT/new-sizes-{qwen,llama}-{stock,lazy,traced}.{txt,json}.
source "$(dirname "$0")/h200_prelude.sh"
for shape in ${SHAPES:-qwen llama}; do
  if [ $shape = qwen ]; then
    [ -f $Q/config.json ] || { step make-qwen; timeout 60 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1; }
    M=$Q
  else
    make_llama
    M=$L
  fi
  for variant in stock lazy traced; do
    step "$shape-$variant"
    timeout ${LIMIT:-150} taskset -c ${CPU:-3} python3 bench/new_batch_sizes.py --model $M --variant $variant \
      --sizes ${SIZES:-1-64} --json-out "$OUT/new-sizes-$shape-$variant.json" > "$OUT/new-sizes-$shape-$variant.txt" 2>&1
    grep -E "traced|first-step excess" "$OUT/new-sizes-$shape-$variant.txt"
  done
done
step done
