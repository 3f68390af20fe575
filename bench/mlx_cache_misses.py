"""How MLX's CUDA attention cache behaves over many prefill shapes.

Runs ``mx.fast.scaled_dot_product_attention`` as a prefill does (bf16, causal,
head dim 128, 16 query heads over 8 KV heads, batch 1) over ``--shapes`` prompt
lengths, each a new shape for MLX's cuDNN attention cache, then over the same
lengths again. Prints the first error (MLX's "Cache thrashing is happening"
comes once the cache has missed twice its capacity), the shapes that ran in
each pass, and the median ms per shape of each pass (the second pass hits the
cache only if it holds every shape). The environment decides the cache's
capacity and the check (``MLX_CUDA_SDPA_CACHE_SIZE``,
``MLX_ENABLE_CACHE_THRASHING_CHECK``); ``--server-defaults`` applies
``runtime.mlx_environment.server_defaults`` first. GPU only.

    python bench/mlx_cache_misses.py --shapes 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def run_pass(mx, lengths: list[int]) -> tuple[list[float], str | None]:
    times: list[float] = []
    for length in lengths:
        q = mx.random.normal((1, 16, length, 128)).astype(mx.bfloat16)
        kv = mx.random.normal((1, 8, length, 128)).astype(mx.bfloat16)
        mx.eval(q, kv)
        began = time.perf_counter()
        try:
            out = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.088, mask="causal")
            mx.eval(out)
        except RuntimeError as exc:
            return times, f"at length {length} (shape {len(times) + 1}): {exc}"
        times.append(1000 * (time.perf_counter() - began))
    return times, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=int, default=600)
    p.add_argument("--server-defaults", action="store_true")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)
    if ns.server_defaults:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from runtime.mlx_environment import server_defaults

        server_defaults()
    import mlx.core as mx

    lengths = [16 + i for i in range(ns.shapes)]
    result = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
        "shapes": ns.shapes,
    }
    for name in ("first", "second"):
        times, error = run_pass(mx, lengths)
        result[name] = {
            "ran": len(times),
            "error": error,
            "median_ms": round(statistics.median(times), 3) if times else None,
        }
        print(f"{name} pass: {len(times)} shapes ran, median "
              f"{result[name]['median_ms']} ms; error: {error}", flush=True)  # fmt: skip
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
