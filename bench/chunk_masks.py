"""A prompt chunk's attention under mlx-lm's boolean array mask against ``"causal"``.

For one unpadded prompt, mlx-lm's batch cache builds the causal mask as a boolean
array (one row a query, one column a key, the prefix all visible); MLX's
``"causal"`` is the same mask, aligned to the last key, with nothing to read. This
times ``mx.fast.scaled_dot_product_attention`` both ways for chunks after prefixes
of several lengths (the Qwen3-0.6B shape's heads by default, bf16) and reports the
largest difference between the two outputs, which must stay at bf16 rounding.

    python bench/chunk_masks.py --prefixes 0,8192,24576 --chunk 2048 --json-out masks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefixes", default="0,4096,12288,24576,30720")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json-out")
    ns = p.parse_args()
    rows = []
    print(f"{'prefix':>7} {'array ms':>9} {'causal ms':>10} {'max |diff|':>11}")
    for prefix in (int(x) for x in ns.prefixes.split(",")):
        n_keys = prefix + ns.chunk
        q = mx.random.normal((1, ns.heads, ns.chunk, ns.head_dim)).astype(mx.bfloat16)
        k = mx.random.normal((1, ns.kv_heads, n_keys, ns.head_dim)).astype(mx.bfloat16)
        v = mx.random.normal((1, ns.kv_heads, n_keys, ns.head_dim)).astype(mx.bfloat16)
        array_mask = create_causal_mask(ns.chunk, offset=prefix, left_padding=mx.array([0]))
        mx.eval(q, k, v, array_mask)
        scale = ns.head_dim ** -0.5
        outs, times = {}, {"array": [], "causal": []}
        for rep in range(ns.reps + 1):  # the first builds the graphs, untimed
            for name, mask in (("array", array_mask), ("causal", "causal")):
                mx.synchronize()
                began = time.perf_counter()
                out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
                mx.eval(out)
                if rep:
                    times[name].append((time.perf_counter() - began) * 1000)
                outs[name] = out
        diff = mx.abs(outs["array"].astype(mx.float32) - outs["causal"].astype(mx.float32))
        row = {"prefix": prefix, "chunk": ns.chunk,
               "array_ms": statistics.median(times["array"]),
               "causal_ms": statistics.median(times["causal"]),
               "max_abs_diff": diff.max().item()}
        rows.append(row)
        print(f"{prefix:>7} {row['array_ms']:>9.2f} {row['causal_ms']:>10.2f} {row['max_abs_diff']:>11.4f}")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
