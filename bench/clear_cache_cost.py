"""What mlx-lm's ``mx.clear_cache()`` after every prefill chunk costs a paced prefill.

A Qwen3-0.6B-shaped random model; a ``BatchGenerator`` with 16 sequences decoding
while a long prompt is prefilled in small chunks (``--chunk``). Steps are timed with
MLX's ``clear_cache`` as it is and as a no-op (the buffer cache then stays within
``mx.set_cache_limit``), in alternated repetitions. Prints one line per run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import qwen3


def build_model(tiny: bool):
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64 if tiny else 1024, num_hidden_layers=2 if tiny else 28,
        intermediate_size=128 if tiny else 3072, num_attention_heads=4 if tiny else 16,
        num_key_value_heads=2 if tiny else 8, head_dim=16 if tiny else 128, rms_norm_eps=1e-6,
        vocab_size=1024 if tiny else 151936, max_position_embeddings=32768, rope_theta=1e6,
        tie_word_embeddings=True,
    )
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def run(model, chunk: int, long_tokens: int, keep_cache: bool) -> list[float]:
    original = mx.clear_cache
    if keep_cache:
        mx.clear_cache = lambda: None
    try:
        gen = BatchGenerator(model, max_tokens=100000, prefill_step_size=2048,
                             completion_batch_size=64, prefill_batch_size=8)
        gen.insert([[1 + i] * 64 for i in range(16)], max_tokens=[100000] * 16)
        for _ in range(20):
            gen.next()
        gen.prefill_step_size = chunk
        gen.insert([[10 + i % 900 for i in range(long_tokens)]], max_tokens=[1])
        steps = []
        for _ in range(long_tokens // chunk - 2):
            began = time.perf_counter()
            gen.next()
            steps.append(1000 * (time.perf_counter() - began))
        return steps
    finally:
        mx.clear_cache = original


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a tiny model (to try the script on a CPU)")
    ns = p.parse_args()
    model = build_model(ns.tiny)
    run(model, ns.chunk, 1024, False)  # warm-up
    for rep in range(ns.reps):
        for keep in (False, True):
            steps = run(model, ns.chunk, ns.long_tokens, keep)
            print(f"rep {rep} clear_cache {'no-op' if keep else 'as is'}: step p50 "
                  f"{statistics.median(steps):.1f} ms, p90 {sorted(steps)[int(0.9 * len(steps))]:.1f} ms, "
                  f"{len(steps)} steps of {ns.chunk} prompt tokens + 16 decoding", flush=True)


if __name__ == "__main__":
    main()
