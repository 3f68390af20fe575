"""A model's decode step over a batch holding its rows' shared prefix once, against the
batch holding it in every row.

``--rows`` rows decode together; each holds a prefix of ``--prefix`` tokens shared by
all and ``--own`` tokens of its own at most (the rows spread from half of it to all of
it, left-padded as mlx-lm's batch holds them). Two batches of KV layers are built with
random keys and values, one a layer at a time through ``runtime.held_prefix``'s
``hold_prefix_once`` (the prefix held once), the other as a decoding batch holds them
today. The model (a directory: ``bench/make_shaped_model.py``'s) takes the server's
decode path (the compiled layers, and on CUDA the installed decode attention), and
decode steps are timed alternately over the two batches, ``--steps`` steps a round for
``--rounds`` rounds after one warm-up round each.

Reported per layout: the step's milliseconds (median and fastest), the rows' tokens a
second at the median, and the KV gigabytes it held as built.

    python bench/held_prefix_step.py --model /tmp/m/qwen3-0.6b --rows 16 --prefix 24000 --own 3000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.compiled_decode import install_compiled_decode  # noqa: E402
from runtime.cuda_attention import install_prefill_attention  # noqa: E402
from runtime.cuda_decode_attention import install_masked_decode  # noqa: E402
from runtime.held_prefix import held_prefix, hold_prefix_once  # noqa: E402

LAYOUTS = ("held", "every-row")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory (mlx-lm's load)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prefix", type=int, default=24000)
    p.add_argument("--own", type=int, default=3000)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", help="write the JSON here")
    ns = p.parse_args(argv)
    layouts = [name.strip() for name in ns.layouts.split(",") if name.strip()]
    if not layouts or set(layouts) - set(LAYOUTS):
        p.error(f"--layouts: choose from {LAYOUTS}")

    import mlx.core as mx
    from mlx_lm import load

    install_prefill_attention(mx)
    install_masked_decode(mx, "kernel")
    model, _ = load(ns.model)
    compiled = install_compiled_decode(model)
    batches = {name: batch(mx, model, ns, held=name == "held") for name in layouts}
    built = {name: kv_bytes(layers) for name, layers in batches.items()}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for round_ in range(ns.rounds + 1):
        for name in layouts:
            steps = run(mx, model, batches[name], ns.rows, ns.steps)
            if round_:  # the first round warms up
                times[name] += steps
    results = {
        "device": str(mx.default_device()), "model": ns.model, "rows": ns.rows,
        "prefix": ns.prefix, "own": ns.own, "compiled_layers": compiled,
        "layouts": {name: {
            "step_ms_median": round(statistics.median(t), 3),
            "step_ms_fastest": round(min(t), 3),
            "tokens_per_s": round(ns.rows / statistics.median(t) * 1e3, 1),
            "kv_bytes": built[name],
            "kv_gb": round(built[name] / 1e9, 3)} for name, t in times.items()},
    }
    for name, r in results["layouts"].items():
        print(f"{name:10s} step {r['step_ms_median']:8.2f} ms median "
              f"({r['step_ms_fastest']:.2f} fastest)  {r['tokens_per_s']:8.1f} tok/s  "
              f"KV {r['kv_gb']:.2f} GB")
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def batch(mx, model, ns, *, held: bool) -> list:
    """The decoding batch's KV layers, random, one layer built (and its prefix held once,
    where ``held``) before the next, so that at most one layer is held whole twice."""
    from mlx_lm.models.cache import BatchKVCache

    attention = model.layers[0].self_attn
    kv_heads = attention.n_kv_heads
    dim = model.layers[0].self_attn.k_proj.weight.shape[0] // kv_heads
    dtype = model.layers[0].input_layernorm.weight.dtype
    own = [ns.own - (ns.own // 2) * i // max(1, ns.rows - 1) for i in range(ns.rows)]
    padding = [ns.own - n for n in own]
    length = ns.prefix + ns.own
    layers = []
    for i in range(len(model.layers)):
        cache = BatchKVCache(padding)
        parts = mx.random.split(mx.random.key(i), 2)
        shape = (ns.rows, kv_heads, length, dim)
        keys = mx.random.normal(shape, key=parts[0]).astype(dtype)
        values = mx.random.normal(shape, key=parts[1]).astype(dtype)
        # Exactly as long as the rows (mlx-lm's own update would round it up to a block).
        cache.keys, cache.values, cache._idx = keys, values, length
        cache.offset = cache.offset + length
        mx.eval(cache.keys, cache.values, cache.offset)
        if held:
            hold_prefix_once(mx, [cache], ns.prefix)
        layers.append(cache)
    return layers


def kv_bytes(layers: list) -> int:
    prefix = sum(k.nbytes + v.nbytes for k, v in filter(None, map(held_prefix, layers)))
    return prefix + sum(c.nbytes for c in layers)


def run(mx, model, layers: list, rows: int, steps: int) -> list[float]:
    """``steps`` decode steps over ``layers`` (the keys each writes trimmed after, so the
    batch stays as built); each step's milliseconds."""
    times = []
    for step in range(steps):
        tokens = mx.array([[(7 * step + row) % 1000 + 1] for row in range(rows)])
        mx.synchronize()
        began = time.perf_counter()
        mx.eval(model(tokens, cache=layers))
        mx.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    for cache in layers:
        cache.trim(steps)
    return times


if __name__ == "__main__":
    sys.exit(main())
