"""A decode step with one long sequence among short ones: one batch against lanes.

In-process, the engine's own generator (``make_batch_generator``, compiled
decode path, shared passes): ``--rows`` short sequences decode, then one
sequence of ``--long-tokens`` joins them. Reports the median decode step (ms)
of the short rows alone, of the long row alone, and of all of them together
with the one batch mlx-lm keeps (``--decode-lane-padding 0``: every row padded
to the long one) and with decode lanes (the long row in a batch of its own),
the two alternated rep by rep in fresh generators.

    .venv/bin/python bench/decode_lanes.py --model DIR --rows 16 --long-tokens 8000

Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEPS = 24  # decode steps timed per measurement


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the tiny model, built here)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--short-tokens", type=int, default=200)
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--lane-padding", type=int, default=8192,
                   help="the lanes' padding limit (what --decode-lane-padding sets)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="write the JSON here")
    ns = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load

    from runtime.batch_sampling import BatchSampler, make_batch_generator
    from runtime.compiled_decode import install_compiled_decode, trace_batch_sizes

    model_path = ns.model
    if model_path is None:
        from runtime.tiny_model import build_tiny_model

        model_path = str(build_tiny_model(Path("/tmp/decode-lanes-model"), seed=0))
    model, _ = load(model_path)
    install_compiled_decode(model)
    trace_batch_sizes(model, range(1, ns.rows + 2))
    short = [[10 + (7 * i + j) % 300 for j in range(ns.short_tokens)] for i in range(ns.rows)]
    long_prompt = [10 + (i * 13) % 300 for i in range(ns.long_tokens)]

    def generator(padding: int):
        return make_batch_generator(model, sampler=BatchSampler(), chunk_pass="shared",
                                    lane_padding=padding, completion_batch_size=ns.rows + 8,
                                    prefill_batch_size=8)

    def median_step(gen) -> float:
        times = []
        for _ in range(STEPS):
            began = time.perf_counter()
            gen.next()
            mx.synchronize()
            times.append(1000 * (time.perf_counter() - began))
        return statistics.median(times)

    def decoding(gen, prompts, rows: int) -> None:
        gen.insert(prompts, max_tokens=[100_000] * len(prompts))
        while len(gen._generation_batch) < rows:
            gen.next()
        for _ in range(3):
            gen.next()

    def together(padding: int) -> float:
        gen = generator(padding)
        decoding(gen, short, ns.rows)
        decoding(gen, [long_prompt], ns.rows + 1)
        return median_step(gen)

    results = []
    for rep in range(ns.reps):
        gen = generator(0)
        decoding(gen, short, ns.rows)
        row = {"rep": rep, "short_alone_ms": median_step(gen)}
        gen = generator(0)
        decoding(gen, [long_prompt], 1)
        row["long_alone_ms"] = median_step(gen)
        order = [("one_batch_ms", 0), ("lanes_ms", ns.lane_padding)]
        for name, padding in order if rep % 2 == 0 else order[::-1]:
            row[name] = together(padding)
        results.append(row)
        print(json.dumps(row), flush=True)
    summary = {k: statistics.median(r[k] for r in results)
               for k in ("short_alone_ms", "long_alone_ms", "one_batch_ms", "lanes_ms")}
    print(f"{ns.rows} rows of {ns.short_tokens} tokens and one of {ns.long_tokens}: "
          f"short alone {summary['short_alone_ms']:.1f} ms, long alone "
          f"{summary['long_alone_ms']:.1f}, together in one batch {summary['one_batch_ms']:.1f}, "
          f"in lanes {summary['lanes_ms']:.1f} (medians of {ns.reps} reps)")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"argv": sys.argv, "results": results,
                                            "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
