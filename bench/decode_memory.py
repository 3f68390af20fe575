"""A decoding batch at depth: each step's time and MLX's memory, in mlx-lm's generator and ours.

In-process: ``--rows`` prompts of about ``--tokens`` random tokens (each 37 fewer than
the one before, down to half, so that the rows are padded as sessions' are) are prefilled, then
every row decodes; ``--steps`` decode steps are timed one by one (each waits for the
device), with MLX's active memory after the step and its peak during it. Systems
(``--systems``):

* ``engine``: mlx-lm's ``BatchGenerator`` as the bare engine drives it.
* ``ours``: the server's generator (``make_batch_generator``: compiled decode path,
  shared passes, decode lanes) with the server's attention routes on CUDA;
  ``ours-mlx``: the same with a masked decode step's attention left to MLX
  (``--decode-attention mlx``); ``ours-grouped``: every masked decode step through the
  grouped products (``--decode-attention grouped --decode-grouped-min-mib 0``), however
  shallow; ``ours-grouped-route``: ``--decode-attention grouped`` (the grouped products
  from 512 MiB of reads, MLX's fallback below); ``ours-kernel``: every masked decode step
  through our kernel (``runtime.cuda_masked_decode``), however deep. Each system's
  generator is collected before the next one starts.
* ``buffers``: no model, only a KV cache's update and attention per layer
  (Qwen3-0.6B's 28 layers of 8 KV heads of 128), pipelined as mlx-lm's decode is (the
  next step queued before the last one's output is read); ``buffers-mask``: under the
  boolean mask mlx-lm gives a batch of rows; ``buffers-grouped``: that mask through
  ``runtime.cuda_attention.grouped_attention`` over the keys as they are;
  ``buffers-grouped-aligned``: the same over the buffer up to a multiple of
  ``KEY_ALIGNMENT`` keys, as ``decode_attention`` reads it; ``buffers-rows``: each row
  through MLX's kernel with no mask, over its own keys (a slice past its padding), the
  rows' outputs concatenated; ``buffers-kernel``: the mask through
  ``runtime.cuda_masked_decode.masked_decode_attention``, the buffers read in place;
  ``buffers-kernel-warp``: the same with a key read by a whole warp (32 lanes) instead of
  the few lanes ``elements_per_lane`` gives it.

A step that copies the batch's KV cache instead of writing its new token in place
would show as a peak of about twice the cache. ``--pipelined``: the generators' steps
are not waited for one by one, as in a server (there, a step's buffers may be written
while the step before still runs).

    python bench/decode_memory.py --model DIR --rows 16 --tokens 12000 --steps 40

Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GB = 1e9


def decode_steps(mx, gen, rows: int, prompts: list[list[int]], steps: int,
                 pipelined: bool = False) -> list[dict]:
    """Insert ``prompts``, step until ``rows`` sequences decode, then time ``steps``: each
    waiting for the device, or (``pipelined``) as a server steps, the next step queued
    while the last one may still run."""
    gen.insert(prompts, max_tokens=[100_000] * len(prompts))
    while len(gen._generation_batch) < rows:
        gen.next()
    gen.next()
    mx.synchronize()
    out = []
    for _ in range(steps):
        mx.reset_peak_memory()
        began = time.perf_counter()
        gen.next()
        if not pipelined:
            mx.synchronize()
        out.append({"ms": round(1000 * (time.perf_counter() - began), 2),
                    "active_gb": round(mx.get_active_memory() / GB, 2),
                    "peak_gb": round(mx.get_peak_memory() / GB, 2),
                    "cache_gb": round(mx.get_cache_memory() / GB, 2)})
    return out


def buffer_steps(mx, rows: int, tokens: int, steps: int, masked: bool = False,
                 grouped: str = "", by_row: bool = False, kernel: bool = False,
                 warp_per_key: bool = False) -> list[dict]:
    """``decode_steps`` for a bare KV cache: each step writes one token into every layer's
    buffers (``BatchKVCache``'s slice assignment) and attends over them; ``masked``: under
    a boolean mask (rows, 1, 1, keys) as mlx-lm's ``BatchKVCache`` makes for rows of
    different lengths (here the first row left-padded by 64 tokens). ``grouped``: the
    masked attention through ``runtime.cuda_attention.grouped_attention`` instead of
    MLX's, its keys as they are ("unaligned") or read from the buffer up to a multiple of
    ``KEY_ALIGNMENT`` ("aligned", the keys past the end masked). ``by_row``: no mask, each
    row's attention over its own keys (past its padding) through MLX's kernel.
    ``kernel``: the masked attention through our kernel, over the buffers in place, in its
    own layout or (``warp_per_key``) with each key read by a whole warp."""
    from runtime.cuda_attention import KEY_ALIGNMENT, grouped_attention
    from runtime.cuda_masked_decode import masked_decode_attention

    layers, heads, dim = 28, 8, 128
    shape = (rows, heads, tokens + 256, dim)
    caches = [[mx.zeros(shape, mx.bfloat16), mx.zeros(shape, mx.bfloat16)] for _ in range(layers)]
    mx.eval(caches)
    query = mx.random.normal((rows, 2 * heads, 1, dim)).astype(mx.bfloat16)
    end, previous, out = tokens, None, []
    pads = [64] + [0] * (rows - 1)
    for _ in range(steps + 1):
        mx.reset_peak_memory()
        began = time.perf_counter()
        x, mask = query, None
        seen = end + 1
        if grouped == "aligned":
            seen = -(-seen // KEY_ALIGNMENT) * KEY_ALIGNMENT
        if masked:
            keys_at = mx.arange(seen)
            mask = (keys_at >= mx.array(pads)[:, None]) & (keys_at <= end)
            mask = mask[:, None, None, :]
        for keys, values in caches:
            new = (x[:, :heads] * 0.5).astype(mx.bfloat16)
            keys[..., end:end + 1, :] = new
            values[..., end:end + 1, :] = new
            if by_row:
                x = mx.concatenate([mx.fast.scaled_dot_product_attention(
                    x[r:r + 1], keys[r:r + 1, :, pads[r]:seen, :],
                    values[r:r + 1, :, pads[r]:seen, :], scale=dim ** -0.5)
                    for r in range(rows)])
            elif kernel:
                x = masked_decode_attention(mx, x, keys, values, mask, scale=dim ** -0.5,
                                            lane_elements=dim // 32 if warp_per_key else None)
            elif grouped:
                x = grouped_attention(mx, x, keys[..., :seen, :], values[..., :seen, :],
                                      scale=dim ** -0.5, mask=mask, align=False)
            else:
                x = mx.fast.scaled_dot_product_attention(
                    x, keys[..., :seen, :], values[..., :seen, :], scale=dim ** -0.5, mask=mask)
        end += 1
        mx.async_eval(x)
        if previous is not None:
            # Waits for the step before only: an operation on it would be queued
            # behind this step and wait for both.
            mx.eval(previous)
        previous = x
        out.append({"ms": round(1000 * (time.perf_counter() - began), 2),
                    "active_gb": round(mx.get_active_memory() / GB, 2),
                    "peak_gb": round(mx.get_peak_memory() / GB, 2),
                    "cache_gb": round(mx.get_cache_memory() / GB, 2)})
    return out[1:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the tiny model, built here)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=12000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--systems", default="engine,ours")
    p.add_argument("--pipelined", action="store_true",
                   help="the generators' steps not waited for one by one, as a server runs "
                   "them (a step's buffers may be written while the step before still runs)")
    p.add_argument("--out", help="write the JSON here")
    ns = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from runtime.batch_sampling import BatchSampler, make_batch_generator
    from runtime.compiled_decode import install_compiled_decode, trace_batch_sizes
    from runtime.cuda_attention import install_prefill_attention
    from runtime.cuda_decode_attention import DECODE_GROUPED_MIN_BYTES, install_masked_decode
    from runtime.mlx_environment import PREFILL_STEP_SIZES, default_decode_lane_padding

    model_path = ns.model
    if model_path is None:
        from runtime.tiny_model import build_tiny_model

        model_path = str(build_tiny_model(Path("/tmp/decode-memory-model"), seed=0))
    model, tokenizer = load(model_path)
    rng = random.Random(0)
    vocab = min(tokenizer.vocab_size, 30000)
    # Rows of different lengths, as sessions are (mlx-lm pads them on the left).
    prompts = [[rng.randrange(10, vocab) for _ in range(max(ns.tokens - 37 * i, ns.tokens // 2))]
               for i in range(ns.rows)]
    results = {}
    for system in ns.systems.split(","):
        if system.startswith("buffers"):
            steps = buffer_steps(mx, ns.rows, ns.tokens, ns.steps,
                                 masked=system not in ("buffers", "buffers-rows"),
                                 by_row=system == "buffers-rows",
                                 kernel=system.startswith("buffers-kernel"),
                                 warp_per_key=system == "buffers-kernel-warp",
                                 grouped=(system.removeprefix("buffers-grouped").strip("-")
                                          or "unaligned")
                                 if system.startswith("buffers-grouped") else "")
        elif system == "engine":
            # One prompt at a time: mlx-lm prefills a batch under one array mask, whose
            # scores for eight 12k prompts ran an H100 out of memory.
            gen = BatchGenerator(model, completion_batch_size=ns.rows + 8, prefill_batch_size=1)
        else:
            # The server's attention routes, as its engine installs them (CUDA only);
            # "ours-mlx": a masked decode step's attention left to MLX; "ours-grouped":
            # every one grouped; "ours-kernel": every one through our kernel.
            install_prefill_attention(mx, full_chunk=PREFILL_STEP_SIZES["gpu"])
            least = {"ours-grouped": 0, "ours-kernel": 1 << 50}.get(
                system, DECODE_GROUPED_MIN_BYTES)
            mode = "grouped" if system in ("ours-grouped", "ours-grouped-route") else "kernel"
            if install_masked_decode(mx, mode, min_bytes=least):
                mx.fast.scaled_dot_product_attention.grouped_decode = system != "ours-mlx"
            install_compiled_decode(model)
            trace_batch_sizes(model, range(1, ns.rows + 2))
            gen = make_batch_generator(model, sampler=BatchSampler(), chunk_pass="shared",
                                       lane_padding=default_decode_lane_padding(mx),
                                       completion_batch_size=ns.rows + 8, prefill_batch_size=1)
        if not system.startswith("buffers"):
            steps = decode_steps(mx, gen, ns.rows, prompts, ns.steps, pipelined=ns.pipelined)
            del gen
        # The generator's KV cache sits in reference cycles: collected now, or the next
        # system runs beside it (its active memory doubled, its steps slower).
        gc.collect()
        mx.clear_cache()
        ms = [s["ms"] for s in steps]
        results[system] = {"steps": steps, "p50_ms": statistics.median(ms), "max_ms": max(ms),
                           "peak_gb": max(s["peak_gb"] for s in steps),
                           "active_gb": statistics.median(s["active_gb"] for s in steps)}
        print(f"{system}: {ns.rows} rows at {ns.tokens} tokens: step p50 {results[system]['p50_ms']:.1f} "
              f"ms, max {max(ms):.1f}; active {results[system]['active_gb']:.2f} GB, "
              f"peak {results[system]['peak_gb']:.2f}", flush=True)
        print("  " + " ".join(f"{s['ms']:.0f}/{s['peak_gb']:.1f}" for s in steps[:30]), flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
