#!/bin/bash
# Issue 15, eleventh session: MLX's cuDNN attention and the server's prefill steps, on one
# H200 after .gpu/stage2.sh and the .whl install.
#   1. bench/prefill_shapes.py on SHAPE (qwen3-0.6b, the default, or llama3-8b) with the server's
#      MLX settings, once with cuDNN attention (MLX's default) and once with
#      MLX_CUDA_USE_CUDNN_SDPA=0 (MLX's unfused fallback everywhere) and once as the server
#      runs (unfused: prefill attention unfused, decoding as MLX picks; MODES picks among the
#      three): prefill groups over many prompt
#      lengths (first pass: every shape new; second: cached), long prompts, decode steps
#      (SHAPES_ARGS: more arguments);
#   2. DECODE_REPS (default 0) more processes per mode, alternated, timing decode steps only
#      (DECODE: the ROWSxKV list);
#   3. unless PINNED=0: bench/h200_pinned.sh on the same shape with VARIANTS (default: the tree
#      in .gpu/cudnn, a build whose prefill attention is MLX's choice).
# Results in $OUT: shapes-{cudnn,fallback}.{json,txt}, decode-*.json, cudnn.{txt,json}.
source "$(dirname "$0")/h200_prelude.sh"
if [ "${SHAPE:=qwen3-0.6b}" = qwen3-0.6b ]; then
  [ -f $Q/config.json ] || { step make-qwen; timeout 60 python3 bench/make_shaped_model.py qwen3-0.6b $Q > "$OUT/make-qwen.log" 2>&1; }
  M=$Q
else
  make_llama; M=$L
fi
export SHAPE
shapes() {  # MODE NAME ARGS...
  local mode=$1 name=$2; shift 2
  step "$name $mode"
  local extra=()
  if [ $mode = fallback ]; then export MLX_CUDA_USE_CUDNN_SDPA=0; fi
  if [ $mode = unfused ]; then extra=(--unfused-prefill); fi
  timeout ${SHAPES_LIMIT:-150} python3 bench/prefill_shapes.py --model $M --server-defaults \
    "${extra[@]}" --json-out "$OUT/$name-$mode.json" "$@" > "$OUT/$name-$mode.txt" 2>&1
  cat "$OUT/$name-$mode.txt"
  unset MLX_CUDA_USE_CUDNN_SDPA
}
for mode in ${MODES:-cudnn fallback unfused}; do shapes $mode shapes ${SHAPES_ARGS:-}; done
for rep in $(seq 1 ${DECODE_REPS:-0}); do
  for mode in ${DECODE_MODES:-fallback cudnn}; do
    shapes $mode decode$rep --groups '' --long '' --decode ${DECODE:-1x300,1x1100,1x4000,8x300}
  done
done
if [ "${PINNED:-1}" != 0 ]; then
  VARIANTS=${VARIANTS:-cudnn@.gpu/cudnn} JSON=${JSON:-cudnn} bash "$(dirname "$0")/h200_pinned.sh"
fi
step done
