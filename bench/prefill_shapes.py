"""What a prefill step costs on the GPU by shape, with and without MLX's cuDNN attention.

MLX's CUDA backend runs a prefill's attention through a cuDNN
graph built for the exact shapes and strides of the call (batch, prompt length,
KV length, mask) and kept in an LRU cache: a shape not seen before builds one on
the calling thread (about 47 ms on an H200, `bench/mlx_cache_misses.py`), and a
server meets new prefill shapes all the time. ``MLX_CUDA_USE_CUDNN_SDPA=0``
sends prefill attention to MLX's unfused fallback instead (no per-shape graph).

This script loads a model and runs mlx-lm's own prefill
(``PromptProcessingBatch.prompt``, fresh caches, right-padded groups as the
server's prefill groups are) over groups of B prompts for many lengths, twice:
the first pass meets every shape for the first time, the second pass finds them
in MLX's caches. Then long prompts (one row, chunks of ``--prefill-step-size``)
and decode steps (``GenerationBatch``) at a few batch sizes and KV lengths.
It prints and writes (``--json-out``) the median ms per shape of each group.
Run it once per environment in separate processes (each cache reads its
variable once):

    python bench/prefill_shapes.py --model DIR --json-out cudnn.json
    MLX_CUDA_USE_CUDNN_SDPA=0 python bench/prefill_shapes.py --model DIR --json-out fallback.json
    python bench/prefill_shapes.py --model DIR --unfused-prefill --json-out unfused.json

(the last as the server runs: prefill attention unfused, decoding as MLX picks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def prompt_batch(model, lengths: list[int], step_size: int):
    """A fresh prefill group of prompts of these lengths, and its tokens."""
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    tokens = [[(7 * i + 3 * j) % 1000 + 10 for j in range(n)] for i, n in enumerate(lengths)]
    caches = [make_prompt_cache(model) for _ in lengths]
    batch = PromptProcessingBatch(
        model, list(range(len(lengths))), caches, prefill_step_size=step_size
    )
    return batch, tokens


def prefill_ms(mx, model, group: list[int], step_size: int) -> float:
    batch, tokens = prompt_batch(model, group, step_size)
    mx.synchronize()
    began = time.perf_counter()
    batch.prompt(tokens)
    mx.synchronize()
    return 1000 * (time.perf_counter() - began)


def decode_ms(mx, model, rows: int, kv: int, steps: int) -> float:
    batch, tokens = prompt_batch(model, [kv - i for i in range(rows)], 2048)
    gen = batch.generate(tokens)
    for _ in range(3):  # warm
        gen.next()
    mx.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        gen.next()
    mx.synchronize()
    return 1000 * (time.perf_counter() - began) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="100:400:6", help="first:last:step prompt lengths")
    p.add_argument("--groups", default="1,4,8", help="prompts per prefill group")
    p.add_argument("--long", default="1024,2048,4096,8192", help="one-row long prompts")
    p.add_argument("--decode", default="1x300,1x1100,8x300,64x300", help="ROWSxKV")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--server-defaults", action="store_true",
                   help="apply runtime.mlx_environment.server_defaults first")
    p.add_argument("--unfused-prefill", action="store_true",
                   help="route prefill attention to MLX's unfused path as the server does "
                   "(runtime.cuda_attention.install_prefill_attention)")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from runtime.cuda_attention import install_prefill_attention
    from runtime.mlx_environment import server_defaults

    if ns.server_defaults:
        server_defaults()
    import mlx.core as mx

    unfused = ns.unfused_prefill and install_prefill_attention(mx)
    from mlx_lm import load

    model, _ = load(ns.model)
    first, last, stride = (int(x) for x in ns.lengths.split(":"))
    lengths = list(range(first, last + 1, stride))
    result: dict = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
        "unfused_prefill": unfused,
        "model": ns.model,
        "lengths": [first, last, stride],
        "prefill": {},
        "long": {},
        "decode": {},
    }
    prefill_ms(mx, model, [64], ns.prefill_step_size)  # kernels' first use, not a shape count
    decode_ms(mx, model, 1, 64, 3)
    for size in (int(g) for g in ns.groups.split(",") if g):
        for pass_name in ("first", "second"):
            times = [
                prefill_ms(mx, model, [n - i for i in range(size)], ns.prefill_step_size)
                for n in lengths
            ]
            result["prefill"][f"{size}-{pass_name}"] = {
                "median_ms": round(statistics.median(times), 3),
                "max_ms": round(max(times), 3),
                "shapes": len(times),
            }
            print(f"prefill group {size} {pass_name:6s} pass: median {statistics.median(times):7.2f} "
                  f"ms, max {max(times):7.2f} over {len(times)} lengths", flush=True)
    for n in (int(x) for x in ns.long.split(",") if x):
        runs = [prefill_ms(mx, model, [n], ns.prefill_step_size) for _ in range(3)]
        result["long"][str(n)] = [round(t, 2) for t in runs]
        print(f"long prompt {n:6d}: " + ", ".join(f"{t:.1f}" for t in runs) + " ms", flush=True)
    for spec in (s for s in ns.decode.split(",") if s):
        rows, kv = (int(x) for x in spec.split("x"))
        ms = decode_ms(mx, model, rows, kv, 30)
        result["decode"][spec] = round(ms, 3)
        print(f"decode {rows} rows at KV {kv}: {ms:.2f} ms a step", flush=True)
    result["peak_mib"] = round(mx.get_peak_memory() / 2**20, 1)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
