"""What does a decode batch size cost the first time a process meets it? A probe for issue 15.

Owns one measurement. A server's decode batch changes size with every arrival
and finish; a compiled decode step (``runtime.compiled_decode``) is traced anew
for each size it has not met, and MLX's backends may build kernels or plans per
shape besides. For each batch size in ``--sizes`` (in that order) this
prefills that many 16-token rows into a fresh batch KV cache (mlx-lm's
``BatchKVCache``, prefill attention as the server runs it), then times
``--steps`` decode steps one by one (each evaluated before the next): the first
step's excess over the median of the last ones is what meeting the size cost.

One variant a process (so that nothing one variant built helps the other):
``stock`` (mlx-lm's layers), ``lazy`` (the compiled path, each size traced at
its first step) and ``traced`` (the compiled path with every size of
``--sizes`` traced up front by ``trace_batch_sizes``, as the server does at
load; that time is reported). Prints one line per size and a summary; the
JSON holds every step time.

  python bench/new_batch_sizes.py --model M --variant traced --sizes 1-64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.compiled_decode import install_compiled_decode, trace_batch_sizes  # noqa: E402
from runtime.engine.host_speed import cpu_probe_us  # noqa: E402
from runtime.mlx_environment import install_prefill_attention  # noqa: E402

VARIANTS = ("stock", "lazy", "traced")


def parse_sizes(text: str) -> list[int]:
    """``1-4,8,16`` -> [1, 2, 3, 4, 8, 16]."""
    sizes: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        sizes += range(int(low), int(high or low) + 1)
    return sizes


def time_size(model, rows: int, steps: int, prompt_tokens: int = 16) -> list[float]:
    """Prefill ``rows`` rows, then the wall time (ms) of each of ``steps`` decode steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache([0] * rows) for _ in model.layers]
    prompt = mx.random.randint(0, 1000, (rows, prompt_tokens))
    tokens = model(prompt, cache=cache)[:, -1:, :].argmax(axis=-1)
    mx.eval(tokens)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        tokens = model(tokens, cache=cache)[:, -1:, :].argmax(axis=-1)
        mx.eval(tokens)
        times.append(1000 * (time.perf_counter() - began))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--sizes", default="1-64")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load

    install_prefill_attention(mx)
    sizes = parse_sizes(ns.sizes)
    stream = mx.new_stream(mx.default_device())
    result: dict = {"variant": ns.variant, "sizes": {}}
    with mx.stream(stream):
        model, _ = load(ns.model)
        mx.random.seed(0)
        if ns.variant != "stock":
            print(f"compiled decode path on {install_compiled_decode(model)} layers", flush=True)
        if ns.variant == "traced":
            began = time.perf_counter()
            traces = trace_batch_sizes(model, sizes)
            result["trace_s"] = time.perf_counter() - began
            print(f"traced {traces} sizes in {result['trace_s']:.2f} s", flush=True)
        time_size(model, 1, 2)  # the process's first step: every kernel's first use
        excess = []
        for rows in sizes:
            times = time_size(model, rows, ns.steps)
            settled = statistics.median(times[-3:])
            excess.append(times[0] - settled)
            result["sizes"][rows] = {"steps_ms": times, "probe_us": cpu_probe_us()}
            print(f"{ns.variant} rows {rows:3d}: first {times[0]:8.2f} ms, then {settled:6.2f} "
                  f"(excess {times[0] - settled:7.2f}, probe {result['sizes'][rows]['probe_us']:.1f} us)",
                  flush=True)
    result["excess_ms_total"] = sum(excess)
    result["excess_ms_median"] = statistics.median(excess)
    print(f"{ns.variant}: first-step excess over {len(sizes)} sizes: total {sum(excess):.0f} ms, "
          f"median {statistics.median(excess):.2f} ms", flush=True)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
