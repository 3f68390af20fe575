"""A paced chunk's attention after a long prefix, by way of computing it, in-process.

A paced prefill step (``runtime.mixed_step``) attends a chunk of 64-1,024 queries to
every key before it; at 24k-30k keys of context that attention is most of what a step
costs beyond a decode step. This times the attention of one forward pass's layers
(``--layers`` of them, each with its own keys and values, evaluated together as a
pass evaluates them) after prefixes of several lengths, each way:

* ``grouped``: the server's way (``runtime.cuda_attention.ChunkAttention``): the keys
  read in place, two products around a float32 softmax, one boolean mask applied to
  the scores of the chunk's own keys alone (the prefix is visible to every query);
* ``full-mask``: the same with the mask applied to every score, as the server did;
* ``split``: the same, with the second product (weights times values) taken in blocks
  of ``--split-keys`` keys and the blocks' partial sums added, so that the GPU gets
  many independent products instead of one long reduction per KV head;
* ``scores``, ``softmax``: the first product alone, then with the mask and softmax
  (what the parts cost);
* ``cudnn``: MLX's fused attention under ``"causal"`` on exactly the chunk's keys, its
  graph built before the timing (a lower bound: in a server every step is a new shape).

It prints the median milliseconds of each way and the largest difference of each way's
output from ``grouped``'s, and writes them (``--json-out``). The Qwen3-0.6B shape's
attention by default (16 query heads, 8 KV heads of 128, 28 layers, bf16):

    python bench/chunk_attention.py --prefixes 4096,12288,24576,30720 --chunks 64,256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

WAYS = ("grouped", "full-mask", "split", "scores", "softmax", "cudnn")


def split_values(mx, weights, values, block: int):
    """``weights @ values`` (B, H, R, S) x (B, H, S, D) as the sum of its products over
    blocks of ``block`` keys (S a multiple of it), the sum in float32."""
    b, h, r, s = weights.shape
    blocks = s // block
    w = weights.reshape(b, h, r, blocks, block).transpose(0, 1, 3, 2, 4)
    v = values.reshape(b, h, blocks, block, values.shape[-1])
    return (w @ v).astype(mx.float32).sum(axis=2).astype(values.dtype)


def attention_ways(mx, fused, *, prefix, length, heads, kv_heads, dim, split_keys):
    """Each way as a function of (queries, keys buffer, values buffer)."""
    from runtime.cuda_attention import ChunkAttention, grouped_attention

    chunk = ChunkAttention(mx, prefix=prefix, length=length, left_padding=mx.array([0]))
    n_keys, group, scale = chunk.n_keys, heads // kv_heads, dim ** -0.5
    # As many keys as the in-place read, rounded up to whole blocks for the split.
    split_n = -(-n_keys // split_keys) * split_keys
    split_mask = mx.arange(prefix, prefix + length)[:, None] >= mx.arange(split_n)[None]

    def products(q, k, n):
        rows = (q * scale).reshape(1, kv_heads, group * length, dim)
        return (rows @ k[..., :n, :].swapaxes(-1, -2)).reshape(1, kv_heads, group, length, n)

    def masked_softmax(q, k, n, mask):
        p = mx.where(mask, products(q, k, n), mx.finfo(q.dtype).min)
        return mx.softmax(p, axis=-1, precise=True)

    def grouped(q, k, v):
        return chunk(q, SimpleNamespace(keys=k, values=v), scale=scale)

    def full_mask(q, k, v):
        return grouped_attention(mx, q, k[..., :n_keys, :], v[..., :n_keys, :], scale=scale,
                                 mask=chunk.mask)

    def split(q, k, v):
        w = masked_softmax(q, k, split_n, split_mask).reshape(1, kv_heads, group * length, split_n)
        out = split_values(mx, w, v[..., :split_n, :], split_keys)
        return out.reshape(1, heads, length, dim)

    def scores(q, k, v):
        return products(q, k, n_keys)

    def softmax(q, k, v):
        return masked_softmax(q, k, n_keys, chunk.mask[:, :, None])

    def cudnn(q, k, v):
        end = prefix + length
        return fused(q, mx.contiguous(k[..., :end, :]), mx.contiguous(v[..., :end, :]),
                     scale=scale, mask="causal")

    return {"grouped": grouped, "full-mask": full_mask, "split": split, "scores": scores, "softmax": softmax,
            "cudnn": cudnn}, split_n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefixes", default="4096,12288,24576,30720")
    p.add_argument("--chunks", default="64,256")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--split-keys", type=int, default=512)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json-out")
    ns = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import mlx.core as mx

    fused = mx.fast.scaled_dot_product_attention
    ways = ns.ways.split(",")
    rows = []
    print(f"{'prefix':>7} {'chunk':>5} " + " ".join(f"{w:>9}" for w in ways) + "  (ms a pass)")
    for prefix in (int(x) for x in ns.prefixes.split(",")):
        for length in (int(x) for x in ns.chunks.split(",")):
            made, split_n = attention_ways(
                mx, fused, prefix=prefix, length=length, heads=ns.heads,
                kv_heads=ns.kv_heads, dim=ns.head_dim, split_keys=ns.split_keys)
            room = max(split_n, prefix + length) + 256  # a buffer with room to spare
            layers = []
            for _ in range(ns.layers):
                q = mx.random.normal((1, ns.heads, length, ns.head_dim)).astype(mx.bfloat16)
                k = mx.random.normal((1, ns.kv_heads, room, ns.head_dim)).astype(mx.bfloat16)
                v = mx.random.normal((1, ns.kv_heads, room, ns.head_dim)).astype(mx.bfloat16)
                layers.append((q, k, v))
            mx.eval(layers)
            times = {w: [] for w in ways}
            outs = {}
            for rep in range(ns.reps + 1):  # the first builds kernels and graphs, untimed
                for way in ways:
                    mx.synchronize()
                    began = time.perf_counter()
                    out = [made[way](*layer) for layer in layers]
                    mx.eval(out)
                    mx.synchronize()
                    if rep:
                        times[way].append((time.perf_counter() - began) * 1000)
                    outs[way] = out[0]
            row = {"prefix": prefix, "chunk": length,
                   "ms": {w: round(statistics.median(t), 3) for w, t in times.items()},
                   "max_abs_diff": {}}
            if "grouped" in outs:
                ref = outs["grouped"].astype(mx.float32)
                for way in ("full-mask", "split", "cudnn"):
                    if way in outs:
                        diff = mx.abs(outs[way].astype(mx.float32) - ref).max().item()
                        row["max_abs_diff"][way] = round(diff, 5)
            rows.append(row)
            print(f"{prefix:>7} {length:>5} " + " ".join(f"{row['ms'][w]:>9.2f}" for w in ways)
                  + f"  diff {row['max_abs_diff']}")
            del layers, outs
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({"device": str(mx.default_device()), "layers": ns.layers,
                       "split_keys": ns.split_keys, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
