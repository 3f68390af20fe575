"""A decode step's attention with a shared prefix held once, against each row holding it.

Sixteen coding-agent sessions over one 24k-token system prompt decode in one batch; the
batch holds each row's whole KV, the prompt copied once per row. Held once
(``runtime.shared_prefix_attention``), the prefix is read once a step for every row.
This bench builds one decode step's attention for ``--layers`` layers (Qwen3-0.6B's
shape by default: 16 query heads, 8 KV heads of 128, bfloat16) over ``--rows`` rows, a
prefix of ``--prefix`` tokens and each row's own ``--own`` tokens at most (rows spread
from half of it to all of it, left-padded as mlx-lm's batch holds them), and times
each route's step (one evaluation of every layer's attention), the routes alternated
``--reps`` times after one warm-up each:

- ``shared``: the prefix held once, ``shared_prefix_attention`` (its operations, on
  every backend);
- ``held-kernel``: the prefix held once, our masked decode kernel's variant over a held
  prefix (CUDA only; the server's route for a held layer where it applies);
  ``held-kernel@N``: the same with N rows' queries a block over the prefix (1: a row
  each; the default ``held_rows_per_block``'s);
- ``grouped``: each row holding the prefix, the grouped products the server's decode
  route takes for a large batch (``runtime.cuda_attention.grouped_attention`` over keys
  aligned to 64, as ``decode_attention`` reads them);
- ``kernel``: each row holding the prefix, our masked decode kernel (CUDA only; the
  server's route below 512 MiB a layer);
- ``mlx``: each row holding the prefix, MLX's ``scaled_dot_product_attention`` under the
  boolean mask.

Reported per route: the step's milliseconds (median and fastest), and the KV gigabytes
its layout holds for the layers.

    python bench/shared_prefix_attention.py --rows 16 --prefix 24000 --own 3000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.cuda_attention import KEY_ALIGNMENT, grouped_attention  # noqa: E402
from runtime.cuda_masked_decode import (  # noqa: E402
    held_prefix_decode_attention,
    kernel_applies,
    masked_decode_attention,
)
from runtime.shared_prefix_attention import shared_prefix_attention  # noqa: E402

ROUTES = ("shared", "held-kernel", "grouped", "kernel", "mlx")
KERNEL_ROUTES = ("held-kernel", "kernel")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prefix", type=int, default=24000)
    p.add_argument("--own", type=int, default=3000)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--out", help="write the JSON here")
    ns = p.parse_args(argv)

    import mlx.core as mx

    routes = [r.strip() for r in ns.routes.split(",") if r.strip()]
    unknown = {r for r in routes if r.split("@")[0] not in ROUTES
               or ("@" in r and (r.split("@")[0] != "held-kernel"
                                 or not r.split("@")[1].isdigit()))}
    if unknown:
        p.error(f"--routes: unknown {sorted(unknown)}; choose from {ROUTES}")
    step = Step(mx, ns)
    if not step.kernel_applies():
        for route in [r for r in routes if r.split("@")[0] in KERNEL_ROUTES]:
            print(f"{route}: not on this device (CUDA only)", file=sys.stderr)
            routes.remove(route)
    times: dict[str, list[float]] = {route: [] for route in routes}
    for route in routes:  # warm-up: builds, traces and the allocator's first buffers
        step.run(route)
    for _ in range(ns.reps):
        for route in routes:
            times[route].append(step.run(route))
    results = {
        "device": str(mx.default_device()), "rows": ns.rows, "prefix": ns.prefix,
        "own": ns.own, "layers": ns.layers, "heads": ns.heads, "kv_heads": ns.kv_heads,
        "dim": ns.dim, "routes": {
            route: {"step_ms_median": round(statistics.median(t), 3),
                    "step_ms_fastest": round(min(t), 3), "step_ms": [round(x, 3) for x in t],
                    "kv_bytes": step.kv_bytes(route),
                    "kv_gb": round(step.kv_bytes(route) / 1e9, 3)}
            for route, t in times.items()},
    }
    for route, r in results["routes"].items():
        print(f"{route:13s} step {r['step_ms_median']:9.2f} ms median "
              f"({r['step_ms_fastest']:.2f} fastest)  KV {r['kv_gb']:.2f} GB")
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


class Step:
    """One decode step's layers in both layouts: the prefix held once with each row's own
    keys after it, and each row holding the prefix; the rows' queries and masks."""

    def __init__(self, mx, ns):
        self.mx = mx
        rows, prefix, own = ns.rows, ns.prefix, ns.own
        self.scale = ns.dim ** -0.5
        dtype = mx.bfloat16
        # Row i holds own_i of ``own`` keys, left-padded: from half of ``own`` to all of it.
        lengths = [own - (own // 2) * i // max(1, rows - 1) for i in range(rows)]
        padding = mx.array([own - n for n in lengths])
        positions = mx.arange(own)
        self.own_mask = (positions[None] >= padding[:, None])[:, None, None, :]
        whole = prefix + own
        self.n_keys = -(-whole // KEY_ALIGNMENT) * KEY_ALIGNMENT
        whole_at = mx.arange(self.n_keys)
        # Each row holding the prefix: its padding first, then the prefix and its own keys.
        self.whole_mask = ((whole_at[None] >= padding[:, None])
                           & (whole_at[None] < whole))[:, None, None, :]
        self.layers = []
        for layer in range(ns.layers):
            key = mx.random.key(layer)
            parts = mx.random.split(key, 6)
            layer_arrays = {
                "queries": mx.random.normal((rows, ns.heads, 1, ns.dim), key=parts[0]).astype(dtype),
                "prefix_keys": mx.random.normal((1, ns.kv_heads, prefix, ns.dim), key=parts[1]).astype(dtype),
                "prefix_values": mx.random.normal((1, ns.kv_heads, prefix, ns.dim), key=parts[2]).astype(dtype),
                "own_keys": mx.random.normal((rows, ns.kv_heads, own, ns.dim), key=parts[3]).astype(dtype),
                "own_values": mx.random.normal((rows, ns.kv_heads, own, ns.dim), key=parts[4]).astype(dtype),
            }
            mx.eval(layer_arrays)
            whole_keys = mx.random.normal((rows, ns.kv_heads, self.n_keys, ns.dim), key=parts[5]).astype(dtype)
            mx.eval(whole_keys)
            layer_arrays["whole_keys"] = whole_keys
            layer_arrays["whole_values"] = whole_keys * 0.5
            mx.eval(layer_arrays["whole_values"])
            self.layers.append(layer_arrays)

    def kernel_applies(self) -> bool:
        first = self.layers[0]
        try:
            return kernel_applies(self.mx, first["queries"], first["whole_keys"],
                                  first["whole_values"], self.whole_mask) and \
                self.mx.default_device() == self.mx.gpu and self.mx.cuda.is_available()
        except AttributeError:
            return False

    def kv_bytes(self, route: str) -> int:
        names = (("prefix_keys", "prefix_values", "own_keys", "own_values")
                 if route.split("@")[0] in ("shared", "held-kernel")
                 else ("whole_keys", "whole_values"))
        return sum(layer[name].nbytes for layer in self.layers for name in names)

    def attention(self, route: str, layer: dict):
        mx = self.mx
        if route == "shared":
            return shared_prefix_attention(
                mx, layer["queries"], layer["prefix_keys"], layer["prefix_values"],
                layer["own_keys"], layer["own_values"], scale=self.scale, mask=self.own_mask)
        if route.split("@")[0] == "held-kernel":
            group = int(route.split("@")[1]) if "@" in route else None
            return held_prefix_decode_attention(
                mx, layer["queries"], layer["prefix_keys"], layer["prefix_values"],
                layer["own_keys"], layer["own_values"], self.own_mask, scale=self.scale,
                rows_per_block=group)
        if route == "grouped":
            return grouped_attention(mx, layer["queries"], layer["whole_keys"],
                                     layer["whole_values"], scale=self.scale,
                                     mask=self.whole_mask, align=False)
        if route == "kernel":
            return masked_decode_attention(mx, layer["queries"], layer["whole_keys"],
                                           layer["whole_values"], self.whole_mask,
                                           scale=self.scale)
        return mx.fast.scaled_dot_product_attention(
            layer["queries"], layer["whole_keys"], layer["whole_values"], scale=self.scale,
            mask=self.whole_mask)

    def run(self, route: str) -> float:
        """One step's attention over every layer, evaluated at once; its milliseconds."""
        mx = self.mx
        mx.synchronize()
        began = time.perf_counter()
        mx.eval([self.attention(route, layer) for layer in self.layers])
        mx.synchronize()
        return (time.perf_counter() - began) * 1e3


if __name__ == "__main__":
    sys.exit(main())
