"""What taking a finished row's KV out of a decoding batch costs the host, with a step
in flight.

A batch of 17 rows of plain ``BatchKVCache`` layers (Qwen3-0.6B's 28 layers, 8 KV
heads of 128, bfloat16), its rows left-padded, at a depth of ``--depth`` tokens.
Before each timed call the device is given a chain of matrix products to run
(``--busy-ms`` of work, queued with ``mx.async_eval``), as a decode step would be
in flight when a sequence finishes. Timed, on the host (milliseconds a call):

- ``extract``: mlx-lm's ``extract`` of one row from every layer, as a finishing
  sequence's cache is taken, where the layers' paddings were computed by the device
  (a ``extend`` as rows joined, evaluated since);
- ``extract-host``: the same where the paddings were made on the host;
- ``extract-queued``: ``extract`` and its 56 copies queued (``mx.async_eval``), as
  the prompt cache queues a stored entry's;
- ``filter``: ``runtime.mlx_lm_internals.filter_layers`` dropping that row (device
  paddings), then ``filter-host`` (host paddings);
- ``read-one`` / ``read-all``: reading the paddings of one layer / of every layer back
  (``tolist``), device-computed.

Then the same with nothing in flight (``idle``). Prints one JSON line per case and
writes them with ``--json-out``. On the CPU the device is the CPU stream.

What this cannot show: in a running server, with a step's kernels in flight
rather than this chain of products, the first read of a padding the device made
(MLX copies it out of device memory then) took 0.2-0.5 ms a layer on an H100;
``bench/extract_probe/`` times that inside the server (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.mlx_lm_internals import filter_layers  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 28, 8, 128


def batch_layers(rows: int, depth: int, *, host_paddings: bool) -> list:
    """``rows`` rows at ``depth`` (each row's padding 0-15), as a join leaves them."""
    layers = []
    for _ in range(LAYERS):
        first = BatchKVCache([i % 16 for i in range(rows - 1)])
        shape = (rows - 1, HEADS, depth, HEAD_DIM)
        first.update_and_fetch(mx.zeros(shape, mx.bfloat16), mx.zeros(shape, mx.bfloat16))
        joining = BatchKVCache([0])
        shape = (1, HEADS, depth // 2, HEAD_DIM)
        joining.update_and_fetch(mx.zeros(shape, mx.bfloat16), mx.zeros(shape, mx.bfloat16))
        first.extend(joining)  # the device computes the joined paddings
        layers.append(first)
    mx.eval([c.state for c in layers])
    if host_paddings:
        for c in layers:
            c.left_padding = mx.array(c.left_padding.tolist(), dtype=c.left_padding.dtype)
        mx.eval([c.left_padding for c in layers])
    return layers


def keep_busy(work: mx.array, products: int) -> None:
    x = work
    for _ in range(products):
        x = (x @ work) * 0.5
    mx.async_eval(x)


def products_for(ms: float, work: mx.array) -> int:
    """How many products of ``work`` take about ``ms`` on the device."""
    keep_busy(work, 4)
    mx.synchronize()
    began = time.perf_counter()
    keep_busy(work, 20)
    mx.synchronize()
    each = (time.perf_counter() - began) * 1000 / 20
    return max(1, round(ms / max(each, 1e-3)))


def timed(case: str, layers: list, row: int) -> float:
    began = time.perf_counter()
    if case.startswith("extract"):
        caches = [c.extract(row) for c in layers]
        if case == "extract-queued":  # and its copies queued, as the prompt cache does
            mx.async_eval([a for c in caches for a in (c.keys, c.values)])
    elif case.startswith("filter"):
        keep = [i for i in range(layers[0].offset.shape[0]) if i != row]
        filter_layers(layers, keep)
    elif case == "read-one":
        layers[0].left_padding.tolist()
    else:
        [c.left_padding.tolist() for c in layers]
    return (time.perf_counter() - began) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=1024)
    p.add_argument("--rows", type=int, default=17)
    p.add_argument("--busy-ms", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args()
    work = mx.random.normal((2048, 2048)).astype(mx.bfloat16)
    products = products_for(ns.busy_ms, work)
    results = []
    for busy in (True, False):
        for case in ("extract", "extract-host", "extract-queued", "filter", "filter-host",
                     "read-one", "read-all"):
            times = []
            for _ in range(ns.reps):
                layers = batch_layers(ns.rows, ns.depth, host_paddings=case.endswith("host"))
                if case.startswith("read"):
                    for c in layers:  # device-computed, evaluated: as the join left them
                        c.left_padding = c.left_padding + 0
                    mx.eval([c.left_padding for c in layers])
                mx.synchronize()
                if busy:
                    keep_busy(work, products)
                times.append(timed(case, layers, ns.rows - 1))
                mx.synchronize()
            row = {"case": case, "in_flight": busy, "busy_products": products if busy else 0,
                   "ms_p50": statistics.median(times), "ms_max": max(times),
                   "device": str(mx.default_device())}
            print(json.dumps(row), flush=True)
            results.append(row)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))


if __name__ == "__main__":
    main()
