"""What a decoding batch's whole-batch copies cost on the device: a row leaving, a row joining.

mlx-lm keeps a decoding batch's KV cache in one array per layer for keys and one for
values (``BatchKVCache``), and copies all of them when a row leaves (its ``filter``
selects the kept rows into new arrays) or joins (its ``extend`` pads both sides and
concatenates them). In a server's step trace (docs/performance.md) these steps took
100-150 ms at 16 rows of 14k tokens on an H100, against a 12-14 ms decode step.

A batch of ``--rows`` rows of ``--tokens`` keys (Qwen3-0.6B's 28 layers of 8 KV heads
of 128, bfloat16, rows left-padded) is built, and each way of making the copies is
timed over all 56 arrays, evaluated and waited for (milliseconds a copy, median of
``--reps``):

- ``leave-gather``: the kept rows selected by an index array (``keys[rows]``), as
  ``BatchKVCache.filter`` and ``runtime.mlx_lm_internals.filter_layers`` did;
- ``leave-runs``: the kept rows as runs of consecutive rows, sliced and concatenated;
- ``leave-gather-trimmed`` / ``leave-runs-trimmed``: the same after the shared left
  padding is trimmed (a strided view: the longest row left);
- ``join``: one row of as many keys joining (mlx-lm's ``extend``: pad, concatenate);
- ``join-longer``: one row 64 keys longer joining, which pads the batch's own rows
  (copied, then copied again into the concatenation);
- ``join-longer-once``: the same join written into one new array a layer
  (``runtime.batch_layers.extend_layers``);
- ``align-roll``: a prompt batch's rows, after chunks of different lengths, rolled
  to end together by mlx-lm's ``BatchKVCache.finalize`` (``dynamic_roll``: a gather);
- ``align-slices``: the same roll by slices (``runtime.batch_layers.rolled_rows``);
- ``join-fill``: the same row written into a vacant row's place instead
  (``runtime.vacant_rows``: a slice assignment, in place where MLX can donate the
  buffer; its bandwidth counts the row).

With the batch's bytes and the copy's bandwidth (bytes read and written a second).
Writes JSON with ``--out``.

    python bench/batch_copies.py --rows 16 --tokens 12000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.batch_layers import extend_layers, rolled_rows  # noqa: E402  (the server's own)
from runtime.mlx_lm_internals import layer_paddings, row_runs  # noqa: E402

LAYERS, HEADS, DIM = 28, 8, 128


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=12000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="write the JSON here")
    ns = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    shape = (ns.rows, HEADS, ns.tokens, DIM)
    arrays = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2 * LAYERS)]
    mx.eval(arrays)
    batch_bytes = sum(a.nbytes for a in arrays)
    leaving = ns.rows // 3
    keep = [i for i in range(ns.rows) if i != leaving]
    rows = mx.array(keep)

    def leave(trim: bool, runs: bool) -> list:
        out = []
        for a in arrays:
            if trim:
                a = a[..., 64:, :]
            out.append(mx.concatenate([a[s:e] for s, e in row_runs(keep)]) if runs else a[rows])
        return out

    joining = [mx.contiguous(a[:1]) for a in arrays]  # a joining batch's own arrays
    longer = [mx.pad(a, [(0, 0), (0, 0), (64, 0), (0, 0)]) for a in joining]
    mx.eval(joining, longer)

    def join(theirs_arrays: list, once: bool = False) -> list:
        caches = []
        for i in range(0, len(arrays), 2):
            mine = BatchKVCache([0] * ns.rows)
            mine.keys, mine.values, mine._idx = arrays[i], arrays[i + 1], ns.tokens
            mine.offset = mx.array([ns.tokens] * ns.rows)
            theirs = BatchKVCache([0])
            theirs.keys, theirs.values = theirs_arrays[i], theirs_arrays[i + 1]
            theirs._idx = theirs.keys.shape[2]
            theirs.offset = mx.array([theirs._idx])
            if not once:
                mine.extend(theirs)
            elif not extend_layers([mine], [theirs], layer_paddings([mine]),
                                   layer_paddings([theirs])):
                raise SystemExit("extend_layers declined the join")
            caches += [mine.keys, mine.values]
        return caches

    def fill() -> list:
        """One row of as many keys written into a vacant row's place, in place
        (``runtime.vacant_rows.fill``): every array's row ``leaving``."""
        for a, r in zip(arrays, joining, strict=True):
            a[leaving:leaving + 1, :, :, :] = r
        return arrays

    from mlx_lm.models.cache import dynamic_roll

    shifts = [(37 * i) % 461 for i in range(ns.rows)]  # user turns of up to 461 tokens
    shift_array = mx.array(shifts)[:, None]
    cases = {
        "leave-gather": lambda: leave(False, False),
        "leave-runs": lambda: leave(False, True),
        "leave-gather-trimmed": lambda: leave(True, False),
        "leave-runs-trimmed": lambda: leave(True, True),
        "join": lambda: join(joining),
        "join-longer": lambda: join(longer),
        "join-longer-once": lambda: join(longer, once=True),
        "align-roll": lambda: [dynamic_roll(a, shift_array, axis=2) for a in arrays],
        "align-slices": lambda: [rolled_rows(mx, a, shifts) for a in arrays],
        "join-fill": fill,
    }
    results = {"rows": ns.rows, "tokens": ns.tokens, "batch_gb": round(batch_bytes / 1e9, 2),
               "device": str(mx.default_device()), "cases": {}}
    for name, make in cases.items():
        times = []
        for _ in range(ns.reps):
            mx.synchronize()
            began = time.perf_counter()
            out = make()
            mx.eval(out)
            times.append(1000 * (time.perf_counter() - began))
            # read and written: the new arrays, or (a fill) the row written in place
            moved = 2 * sum(a.nbytes for a in (joining if name == "join-fill" else out))
            del out
        ms = statistics.median(times)
        results["cases"][name] = {"ms": round(ms, 2), "all_ms": [round(t, 2) for t in times],
                                  "gb_per_s": round(moved / ms / 1e6, 1)}
        print(f"{name:22s} {ms:8.2f} ms  ({moved / ms / 1e6:7.1f} GB/s)  "
              + " ".join(f"{t:.1f}" for t in times), flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
