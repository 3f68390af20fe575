"""Sampling cost in mlx-lm's ``BatchGenerator``: per-row samplers against one BatchSampler.

Owns one measurement: decode steps per second of a full batch (every row
decoding, none finishing) at several batch sizes, for

- ``greedy``: mlx-lm's shared greedy sampler (the reference);
- ``shared``: one ``make_sampler(0.7, top_p=0.9)`` object for every row (mlx-lm's
  one-call path, only possible when all rows have the same parameters);
- ``per-row``: one ``make_sampler(0.7, top_p=0.9)`` per row (mlx-lm samples row by
  row as soon as the rows' sampler objects differ);
- ``batch``: ``runtime.batch_sampling.BatchSampler``, every row 0.7 / 0.9;
- ``batch-mixed``: ``BatchSampler`` with per-row temperatures, top-p, top-k,
  min-p and a quarter of the rows seeded (what per-row samplers cannot batch).

Variants alternate within each repetition, so a neighbour's load hits them alike.
``python bench/sampling.py`` (tiny model built on the fly), ``--shape test``
(4096-token vocabulary, bf16), ``--model DIR`` for any model directory (a GPU run:
``--shape qwen3-0.6b``). Prints one line per batch size and variant; ``--json-out``
writes the raw repetitions.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("bench.sampling")

VARIANTS = ("greedy", "shared", "per-row", "batch", "batch-mixed")
PROMPT_TOKENS = 16


def mixed_params(i: int):
    from runtime.messages import SamplingParams

    kinds = [
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=40),
        dict(temperature=0.5, min_p=0.05),
        dict(temperature=0.8, top_p=0.95, top_k=20),
    ]
    return SamplingParams(**kinds[i % 4], seed=i if i % 4 == 3 else None)


def build_generator(model, variant: str, batch: int, stream):
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    from runtime.batch_sampling import BatchSampler, make_batch_generator
    from runtime.messages import SamplingParams

    kwargs = dict(completion_batch_size=batch, prefill_batch_size=batch, stream=stream)
    if variant in ("batch", "batch-mixed"):
        sampler = BatchSampler()
        generator = make_batch_generator(model, sampler=sampler, **kwargs)
        params = [
            mixed_params(i)
            if variant == "batch-mixed"
            else SamplingParams(temperature=0.7, top_p=0.9)
            for i in range(batch)
        ]
        return generator, [None] * batch, (sampler, params)
    generator = BatchGenerator(model, **kwargs)
    if variant == "greedy":
        return generator, [None] * batch, None
    if variant == "shared":
        return generator, [make_sampler(0.7, top_p=0.9)] * batch, None
    return generator, [make_sampler(0.7, top_p=0.9) for _ in range(batch)], None


def measure(
    model, variant: str, batch: int, steps: int, warmup: int, stream
) -> tuple[float, float]:
    """(steps per second, process CPU ms per step) of ``steps`` decode steps, all rows decoding.

    CPU time counts every thread of the process (MLX's too): on a shared CPU it
    is the steadier figure of the work a step takes.
    """
    generator, samplers, registry = build_generator(model, variant, batch, stream)
    prompts = [[(7 * i + j) % 200 + 10 for j in range(PROMPT_TOKENS)] for i in range(batch)]
    uids = generator.insert(prompts, max_tokens=[steps + warmup + 64] * batch, samplers=samplers)
    if registry is not None:
        sampler, params = registry
        for uid, p in zip(uids, params, strict=True):
            sampler.register(uid, p)
    decoding = 0
    while decoding < warmup:  # prompts, the move to decoding, then warm steps
        _, responses = generator.next()
        decoding += len(responses) == batch
    began, cpu_began = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _, responses = generator.next()
        assert len(responses) == batch and all(r.finish_reason is None for r in responses)
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    generator.close()
    return steps / elapsed, cpu * 1000 / steps


def load_model(args):
    from mlx_lm import load

    if args.model:
        return load(args.model)[0], args.model
    tmp = Path(tempfile.mkdtemp(prefix="bench-sampling-"))
    if args.shape == "tiny":
        from runtime.tiny_model import build_tiny_model

        path = build_tiny_model(tmp / "tiny", seed=0)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from make_shaped_model import make_shaped_model

        path = make_shaped_model(args.shape, tmp / args.shape)
    return load(str(path))[0], f"{args.shape} ({path})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: build --shape)")
    parser.add_argument("--shape", default="tiny", help="tiny, or a make_shaped_model shape")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import mlx.core as mx

    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        model, name = load_model(args)
    batches = [int(b) for b in args.batches.split(",")]
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {}
    log.info("median of %d repetitions: steps/s (x greedy), CPU ms per step", args.reps)
    for batch in batches:
        for rep in range(args.reps):
            order = variants if rep % 2 == 0 else variants[::-1]
            for variant in order:
                result = measure(model, variant, batch, args.steps, args.warmup, stream)
                runs.setdefault(str(batch), {}).setdefault(variant, []).append(result)
        by_variant = runs[str(batch)]
        greedy = statistics.median(r for r, _ in by_variant.get("greedy", [(math.nan, 0)]))
        line = [f"batch {batch:3d}"]
        for variant in variants:
            rate = statistics.median(r for r, _ in by_variant[variant])
            cpu = statistics.median(c for _, c in by_variant[variant])
            line.append(f"{variant} {rate:7.1f} ({rate / greedy:4.2f}x) {cpu:6.2f} ms")
        log.info(" | ".join(line))
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "model": name,
                    "device": str(mx.default_device()),
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "runs": runs,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
