#!/bin/bash
# Issue 8 on the nvidia-h200-x2 device, after .gpu/stage2.sh (PYTHONPATH=/tmp/site:$PWD):
# random-weight Llama-3-8B-shaped models, then one-GPU baselines side by side
# (ours on GPU 0, mlx_lm.server on GPU 1), then 2-GPU tensor and pipeline.
set -u
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
W="--max-tokens 128 --prompt-tokens 120 --min-requests 4 --requests-per-client 1"
mkdir -p /tmp/m "$OUT"
(CUDA_VISIBLE_DEVICES=0 python3 bench/make_shaped_model.py llama3-8b /tmp/m/llama8b > /tmp/m/a.log 2>&1 &
 CUDA_VISIBLE_DEVICES=1 python3 bench/make_shaped_model.py llama3-8b-qwen2 /tmp/m/qwen2-8b > /tmp/m/b.log 2>&1 &
 wait)
date
M="--model /tmp/m/llama8b --pipeline-model /tmp/m/qwen2-8b"
timeout 170 python3 bench/distributed.py $M $W --only single,single-pp --gpu 0 --port 8331 --out "$OUT/one-gpu-ours" > "$OUT/one-gpu-ours.txt" 2>&1 &
timeout 170 python3 bench/distributed.py $M $W --only ref --gpu 1 --port 8332 --out "$OUT/one-gpu-ref" > "$OUT/one-gpu-ref.txt" 2>&1 &
wait
date
timeout 240 python3 bench/distributed.py $M $W --only tp,pp --port 8333 --out "$OUT/two-gpu" > "$OUT/two-gpu.txt" 2>&1
date
tail -n 12 "$OUT"/*.txt
# The device returns at most a few files per call: pack the rest into one.
tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . 2>/dev/null
find "$OUT" -mindepth 1 ! -name results.tgz ! -name '*.txt' -delete
