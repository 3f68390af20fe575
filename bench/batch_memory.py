"""What a decoding batch's copies hold at their peak: evaluated at once, or a layer at a time.

A batch's KV cache is one array per layer for keys and one for values. A row joining
or leaving it, a prompt batch's rows aligned, and a layer growing by a block (mlx-lm's
``update_and_fetch``, inside the model's pass) each make new arrays of the whole batch.
Evaluated together, the old arrays and the new are held whole at once; evaluated a
layer at a time (what the server does with a large batch: ``runtime.batch_layers``'
``layers_evaluated_in_turn`` and ``room_made``), MLX frees each layer's old arrays
before the next layer's are made.

A batch of ``--rows`` rows of ``--tokens`` keys (Qwen3-0.6B's 28 layers of 8 KV heads of
128, bfloat16) is built afresh for each case and way, and the copy is made and
evaluated; reported: the batch's GB, the peak held beyond the larger of the batch
before and after (MLX's peak memory counter), and the milliseconds the copy took
(median of ``--reps``):

- ``join``: a row 64 keys longer joins (the batch's rows padded: ``extend_layers``);
- ``leave``: a third of the rows leave (``filter_layers``);
- ``grow``: the next key past the buffer's end (``update_and_fetch`` grows every layer
  by 256 keys; a layer at a time: ``room_made`` first);
- ``align``: the rows rolled to end together after chunks of different lengths
  (``rolled_rows``).

    python bench/batch_memory.py --rows 16 --tokens 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime import batch_layers  # noqa: E402  (the server's own)
from runtime.mlx_lm_internals import filter_layers, layer_paddings  # noqa: E402

LAYERS, HEADS, DIM = 28, 8, 128
WAYS = ("at-once", "layer-at-a-time")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cases", default="join,leave,grow,align")
    p.add_argument("--out", help="write the JSON here")
    ns = p.parse_args(argv)

    import mlx.core as mx

    results = {"rows": ns.rows, "tokens": ns.tokens, "device": str(mx.default_device()),
               "cases": {}}
    large = batch_layers.large_batch_bytes
    batch_layers.large_batch_bytes = lambda mx_: 0  # a layer at a time wherever asked
    try:
        for case in ns.cases.split(","):
            for way in WAYS:
                row = measure(case, way == "layer-at-a-time", ns.rows, ns.tokens, ns.reps)
                results["cases"].setdefault(case, {})[way] = row
                print(f"{case:6s} {way:16s} batch {row['batch_gb']:6.2f} GB  held beyond it "
                      f"{row['excess_gb']:6.2f} GB  {row['ms']:8.1f} ms", flush=True)
    finally:
        batch_layers.large_batch_bytes = large
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=1))
    return 0


def measure(case: str, one_by_one: bool, rows: int, tokens: int, reps: int) -> dict:
    """``case``'s copy, ``reps`` times on a fresh batch: the batch's GB, the most held
    beyond it, and the median milliseconds."""
    import mlx.core as mx

    excess, times = [], []
    for _ in range(reps):
        caches = batch(rows, tokens)
        batch_gb = held(caches) / 1e9
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        began = time.perf_counter()
        copy(case, caches, one_by_one)
        mx.synchronize()
        times.append(1000 * (time.perf_counter() - began))
        after = mx.get_active_memory()
        excess.append((mx.get_peak_memory() - max(before, after)) / 1e9)
        del caches
    return {"batch_gb": round(batch_gb, 3), "excess_gb": round(max(excess), 3),
            "ms": round(statistics.median(times), 1)}


def batch(rows: int, tokens: int) -> list:
    """A batch's layers: ``rows`` rows of ``tokens`` keys each, the buffer full."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    made = []
    for _ in range(LAYERS):
        c = BatchKVCache([0] * rows)
        c.keys = mx.zeros((rows, HEADS, tokens, DIM), dtype=mx.bfloat16)
        c.values = mx.zeros((rows, HEADS, tokens, DIM), dtype=mx.bfloat16)
        c._idx, c.offset = tokens, mx.array([tokens] * rows)
        made.append(c)
    mx.eval([c.state for c in made])
    return made


def held(caches: list) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in caches)


def copy(case: str, caches: list, one_by_one: bool) -> None:
    """The case's lazy copy of ``caches``, then evaluated at once or a layer at a time."""
    import mlx.core as mx

    rows, tokens = caches[0].keys.shape[0], caches[0]._idx
    if case == "join":
        joining = batch(1, tokens + 64)
        batch_layers.extend_layers(caches, joining, layer_paddings(caches),
                                   layer_paddings(joining))
        del joining
    elif case == "leave":
        filter_layers(caches, [i for i in range(rows) if i % 3])
    elif case == "grow":
        if one_by_one:
            batch_layers.room_made(caches, 1)
        step = mx.zeros((rows, HEADS, 1, DIM), dtype=mx.bfloat16)
        for c in caches:
            c.update_and_fetch(step, step)
    elif case == "align":
        shifts = [(37 * i) % 461 for i in range(rows)]  # user turns of up to 461 tokens
        for c in caches:
            c.keys = batch_layers.rolled_rows(mx, c.keys, shifts)
            c.values = batch_layers.rolled_rows(mx, c.values, shifts)
    if one_by_one:
        batch_layers.layers_evaluated_in_turn(caches)
    mx.eval([c.state for c in caches])


if __name__ == "__main__":
    raise SystemExit(main())
