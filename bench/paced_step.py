"""What one paced prefill step costs at a prompt's depth, by prefill attention path.

A Qwen3-0.6B-shaped random model built in-process; a bare mlx-lm
``BatchGenerator`` with ``--decoders`` sequences decoding (or none) while one long
prompt is prefilled. The prompt advances in full 2,048-token chunks to each depth of
``--depths``; there the step's chunk is set to each size of ``--chunks`` in turn
(alternated, ``--steps`` steps each; the paths' unfused attention takes chunks of
any of these sizes) and every ``next()`` is timed: its wall time
and its thread's CPU time (the host's share: building the graph, launching it). A
decode-only step is timed before the prompt arrives. Prefill attention paths
(``--paths``, all in one process, alternated prompt by prompt):

  cudnn    MLX as installed (a cuDNN graph per new shape)
  float32  the server's unfused path through MLX's fallback (a float32 query)
  half     the server's unfused path in the inputs' precision (grouped_attention); in a
           shared pass the chunk's keys read in place from its cache, one mask for all
           layers (runtime.cuda_attention.ChunkAttention)
  padded   half as it was before that: in every layer the chunk's keys and values
           padded to the alignment by a copy, and the mask padded anew
  none     no attention at all for a prefill (the rest of the step's cost)

and, for each, the step's decode and its chunk as two forward passes (mlx-lm's,
``separate``) or as one (``shared``, ``runtime.mixed_step``; ``--passes``). The model
takes the server's compiled decode path (``--decode-path mlx``: mlx-lm's layers,
which leaves no pass to share) and its batch generator (``make_batch_generator``).

    python bench/paced_step.py --json-out paced.json          # an H200
    python bench/paced_step.py --tiny --depths 256,512        # tries it on a CPU

Prints one line per path, depth and chunk; writes them as JSON (``--json-out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

import runtime.cuda_attention as environment  # noqa: E402
import runtime.mixed_step as mixed_step  # noqa: E402
from bench.clear_cache_cost import build_model  # noqa: E402
from runtime.batch_sampling import BatchSampler, make_batch_generator  # noqa: E402
from runtime.compiled_decode import install_compiled_decode  # noqa: E402
from runtime.cuda_attention import unfused_prefill_attention  # noqa: E402

FULL_CHUNK = 2048


def attention_for(path: str, fused):
    if path == "cudnn":
        return fused
    if path in ("float32", "half", "padded"):  # every chunk of this bench's sizes unfused
        scores = "float32" if path == "float32" else "half"
        return unfused_prefill_attention(fused, mx, block_queries=4096, scores=scores)

    def no_attention(queries, keys, values, *args, **kwargs):
        if queries.shape[2] > 1:
            return queries
        return fused(queries, keys, values, *args, **kwargs)

    return no_attention


def timed_step(gen) -> tuple[float, float, list]:
    wall, cpu = time.perf_counter(), time.thread_time()
    prompts, _ = gen.next()
    return 1000 * (time.perf_counter() - wall), 1000 * (time.thread_time() - cpu), prompts


def run_path(model, path: str, decoders: int, depths: list[int], chunks: list[int],
             steps: int, passes: str = "separate") -> list[dict]:
    fused = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = attention_for(path, fused)
    in_place, kept = mixed_step.chunk_attention, environment.KEPT_MASK_ELEMENTS
    if path == "padded":
        mixed_step.chunk_attention = lambda *args, **kwargs: None
        environment.KEPT_MASK_ELEMENTS = -1
    rows = []
    try:
        gen = make_batch_generator(model, sampler=BatchSampler(), chunk_pass=passes,
                                   max_tokens=1_000_000, prefill_step_size=FULL_CHUNK,
                                   completion_batch_size=64, prefill_batch_size=8)
        decode_ms = None
        if decoders:
            gen.insert([[1 + i] * 64 for i in range(decoders)], max_tokens=[1_000_000] * decoders)
            for _ in range(10):
                gen.next()
            decode_ms = statistics.median(timed_step(gen)[0] for _ in range(20))
        paced = steps * sum(chunks)
        long_tokens = max(depths) + paced + FULL_CHUNK
        gen.insert([[10 + i % 900 for i in range(long_tokens)]], max_tokens=[1])
        done = 0
        for depth in depths:
            while done < depth:
                gen.prefill_step_size = min(FULL_CHUNK, max(64, depth - done))
                done += gen.prefill_step_size
                gen.next()
            start = done
            times: dict[int, list[tuple[float, float]]] = {c: [] for c in chunks}
            for _ in range(steps):
                for chunk in chunks:
                    gen.prefill_step_size = chunk
                    wall, cpu, _ = timed_step(gen)
                    times[chunk].append((wall, cpu))
                    done += chunk
            for chunk, pairs in times.items():
                row = {
                    "path": path, "passes": passes, "decoders": decoders, "depth": start,
                    "chunk": chunk,
                    "step_ms": round(statistics.median(w for w, _ in pairs), 2),
                    "max_ms": round(max(w for w, _ in pairs), 2),
                    "host_ms": round(statistics.median(c for _, c in pairs), 2),
                    "decode_only_ms": None if decode_ms is None else round(decode_ms, 2),
                }
                rows.append(row)
                print(f"{path:8s} {passes:8s} decoders {decoders:2d} depth {start:6d} chunk {chunk:4d}: step "
                      f"{row['step_ms']:7.2f} ms (max {row['max_ms']:7.2f}, host {row['host_ms']:6.2f})"
                      f"  decode-only {row['decode_only_ms']}", flush=True)
        del gen
        gc.collect()  # its KV cache sits in reference cycles; freed before the next pass
    finally:
        mx.fast.scaled_dot_product_attention = fused
        mixed_step.chunk_attention, environment.KEPT_MASK_ELEMENTS = in_place, kept
        mx.synchronize()
        mx.clear_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default="half,float32,cudnn,none")
    p.add_argument("--depths", default="1024,8192,16384,24576",
                   help="where the timed steps start (each depth's steps add to it)")
    p.add_argument("--chunks", default="64,256,1024")
    p.add_argument("--decoders", default="16,0", help="decoding sequences beside the prompt")
    p.add_argument("--steps", type=int, default=4, help="timed steps per chunk size and depth")
    p.add_argument("--passes", default="separate,shared",
                   help="a step's decode and chunk in two forward passes or one")
    p.add_argument("--decode-path", choices=("compiled", "mlx"), default="compiled")
    p.add_argument("--tiny", action="store_true", help="a tiny model (to try it on a CPU)")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)
    model = build_model(ns.tiny)
    if ns.decode_path == "compiled":
        install_compiled_decode(model)
    depths = [int(d) for d in ns.depths.split(",")]
    chunks = [int(c) for c in ns.chunks.split(",")]
    paths = ns.paths.split(",")
    passes = ns.passes.split(",")
    for way in passes:  # kernels' and traces' first use
        run_path(model, paths[0], 2, [min(depths)], chunks, 2, way)
    rows = []
    for decoders in (int(d) for d in ns.decoders.split(",")):
        for path in paths:
            for way in passes:
                rows += run_path(model, path, decoders, depths, chunks, ns.steps, way)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({"device": mx.device_info(), "rows": rows},
                                                indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
