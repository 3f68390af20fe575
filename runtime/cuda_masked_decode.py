"""A decode step's attention under a boolean mask as one CUDA kernel of our own, and its reduction.

Owns ``masked_decode_attention``: a layer's queries (one a row), its KV cache's key and
value buffers and mlx-lm's boolean mask (rows, 1, 1, keys) in; the attention (rows,
query heads, 1, head dim) out. ``runtime.cuda_decode_attention.decode_attention`` calls
it under ``--decode-attention kernel``; ``kernel_applies`` says which calls it takes.
Also ``held_prefix_decode_attention``, the same over a layer holding its rows' shared
prefix once (``runtime.held_prefix``): the prefix's keys and values (one row) besides,
and ``held_kernel_applies``.

Why a kernel: a decoding batch of several rows is padded on the left to one length and
masked, MLX's CUDA kernel for one query a row takes no mask, and MLX's fallback computes
such a layer's attention as several operations (a scale, two matrix products, the mask,
a softmax) where one row's attention is one kernel. A decode step of 2-16 rows is then
bound by the host's cost per operation (docs/performance.md, "H100: a masked decode
step's route by shape"). Here a layer's masked attention is two launches, split over the
keys (flash decoding): the first gives each block of ``KEYS_PER_SPLIT`` keys, per row and
KV head, its running maximum, sum and weighted values for each of that KV head's query
heads, the second merges the blocks. The keys and values are read once per KV head, a
few lanes a key (``elements_per_lane``); a block wholly masked (a row's left padding)
is not read, and in the others a masked key is read with the rest, so that no load waits
for the mask's answer. The buffers are read in place up to the mask's length, so nothing is
copied or padded first. Over a held prefix the first launch's grid is the prefix's
blocks and then each row's own: a block over a span of the prefix computes several
rows' queries (``held_rows_per_block``), each key loaded once for them all, and the
blocks of one span run side by side, so that its keys come from memory once and from
the L2 cache for the other rows' blocks. The operations
this replaces (``runtime.shared_prefix_attention``, about 30 a layer) made four
12k-token sessions' decode step on an H100 10 ms slower than our kernel over each row
holding the prefix.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

from runtime.cuda_masked_decode_source import HEADER, HELD_SOURCE, MERGE_SOURCE, OWN_SOURCE

# Keys one block of the first kernel reads: a 12k-token row makes 47 blocks per KV head.
KEYS_PER_SPLIT = 256
# Threads a block of the first kernel runs (four warps), and keys each group of lanes
# (one key's reader, ``elements_per_lane``) loads at once.
THREADS = 128
KEYS_PER_LOAD = 2
# Elements of a key a lane reads at most (16 half-precision values: two 16-byte loads),
# and the query elements a lane keeps in registers per key at most (its query heads'
# slices, and as many running sums).
MOST_ELEMENTS_PER_LANE = 16
QUERY_ELEMENTS_PER_LANE = 32
HEAD_DIMS = (64, 128, 256)
# Query heads per KV head the first kernel keeps in registers at most.
MOST_QUERIES_PER_KV_HEAD = 8
# Queries a block over a held prefix computes (its rows' query heads of one KV head, each
# key loaded once for them all), by default and at most; the static shared memory a
# block's merge of its warps may take. Four: on an H100, Qwen3-0.6B's shape (two query
# heads a KV head), a 24k prefix's attention at 2-16 rows took 0.76-0.84x the time of a
# row a block with two rows a block, 0.87x with four, 1.02x with eight.
PREFIX_QUERIES_PER_BLOCK = 4
MOST_PREFIX_QUERIES = 16
SHARED_BYTES = 48 * 1024


class _Kernels(threading.local):
    """The kernels, made once per thread (MLX's state is per thread)."""

    split: Any = None
    held_split: Any = None
    merge: Any = None


_kernels = _Kernels()


_SPLIT_OUTPUTS = ["split_values", "split_top", "split_total"]
# What MLX's cuda_kernel is given for each kernel: the attribute of _Kernels it is kept
# in, then its arguments (bench/cuda_source_check.py compiles the same).
KERNELS = {
    "split": {"name": "masked_decode_split",
              "input_names": ["queries", "keys", "values", "mask"],
              "output_names": _SPLIT_OUTPUTS, "source": OWN_SOURCE, "header": HEADER,
              "ensure_row_contiguous": False},
    "held_split": {"name": "held_prefix_decode_split",
                   "input_names": ["queries", "prefix_keys", "prefix_values", "keys",
                                   "values", "mask"],
                   "output_names": _SPLIT_OUTPUTS, "source": HELD_SOURCE, "header": HEADER,
                   "ensure_row_contiguous": False},
    "merge": {"name": "masked_decode_merge", "input_names": _SPLIT_OUTPUTS,
              "output_names": ["attended"], "source": MERGE_SOURCE},
}


def _made(mx) -> _Kernels:
    if _kernels.split is None:
        for attribute, arguments in KERNELS.items():
            setattr(_kernels, attribute, mx.fast.cuda_kernel(**arguments))
    return _kernels


def elements_per_lane(dim: int, queries_per_kv_head: int) -> int:
    """How many of a key's ``dim`` elements one lane of the first kernel reads: as many
    as fit ``QUERY_ELEMENTS_PER_LANE`` over the KV head's query heads (a power of two), at most
    ``MOST_ELEMENTS_PER_LANE``, at least ``dim / 32`` (a warp a key). Fewer lanes a key
    mean wider loads and a shorter sum of each score across lanes: with Qwen3-0.6B's
    shape (head size 128, two query heads a KV head) 16 elements, eight lanes a key."""
    wanted = min(MOST_ELEMENTS_PER_LANE, QUERY_ELEMENTS_PER_LANE // queries_per_kv_head)
    return max(dim // 32, 1 << (wanted.bit_length() - 1))  # a power of two


def kernel_applies(mx, queries, keys, values, mask) -> bool:
    """Whether ``masked_decode_attention`` takes these: one query a row, half precision
    throughout, a head dimension of 64, 128 or 256 for both keys and values, at most
    ``MOST_QUERIES_PER_KV_HEAD`` query heads per KV head (of which there is a whole
    number), and a boolean mask (rows, 1, 1, keys) no longer than the buffers."""
    if queries.ndim != 4 or queries.shape[2] != 1 or mask.ndim != 4:
        return False
    rows, q_heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    return (queries.dtype in (mx.bfloat16, mx.float16)
            and keys.dtype == queries.dtype and values.dtype == queries.dtype
            and mask.dtype == mx.bool_ and dim in HEAD_DIMS
            and keys.shape[3] == dim and values.shape[3] == dim
            and keys.shape[0] == rows and values.shape[:2] == keys.shape[:2]
            and q_heads % kv_heads == 0 and q_heads // kv_heads <= MOST_QUERIES_PER_KV_HEAD
            and mask.shape[0] == rows and mask.shape[1] == 1 and mask.shape[2] == 1
            and 0 < mask.shape[3] <= min(keys.shape[2], values.shape[2]))


def masked_decode_attention(mx, queries, keys, values, mask, *, scale: float,
                            lane_elements: int | None = None):
    """The attention of ``queries`` (rows, query heads, 1, head dim) over the first
    ``mask.shape[-1]`` keys and values of the buffers ``keys`` and ``values`` (rows, KV
    heads, at least that many, head dim), each key where ``mask`` (rows, 1, 1, keys) is
    True; as MLX's ``scaled_dot_product_attention`` under that mask computes it, in
    float32 inside. A row with no key in its mask gets zeros. CUDA only; the caller
    checks ``kernel_applies`` first. ``lane_elements``: a key's elements a lane reads,
    a power of two from ``dim / 32`` to ``dim`` (default ``elements_per_lane``; for
    benchmarks comparing layouts)."""
    splits = -(-mask.shape[-1] // KEYS_PER_SPLIT)
    return _split_and_merged(mx, "split", [queries, keys, values, mask],
                             grid=(splits, queries.shape[0]), splits=splits, scale=scale,
                             lane_elements=lane_elements)


def held_kernel_applies(mx, queries, prefix_keys, prefix_values, keys, values, mask) -> bool:
    """Whether ``held_prefix_decode_attention`` takes these: what ``kernel_applies``
    asks of the rows' own keys, and a prefix of the same KV heads, head dimension and
    dtype held once (one row)."""
    return (kernel_applies(mx, queries, keys, values, mask)
            and prefix_keys.ndim == 4 and prefix_keys.shape[0] == 1
            and prefix_keys.shape[1] == keys.shape[1] and prefix_keys.shape[3] == keys.shape[3]
            and prefix_values.shape == prefix_keys.shape and prefix_keys.shape[2] > 0
            and prefix_keys.dtype == keys.dtype and prefix_values.dtype == values.dtype)


def held_rows_per_block(dim: int, queries_per_kv_head: int, rows: int) -> int:
    """How many rows' queries one block of the held kernel computes over a span of the
    prefix: as many as keep ``PREFIX_QUERIES_PER_BLOCK`` queries (a power of two, their
    merge within ``SHARED_BYTES``) where the batch has that many rows, else one, as over
    the rows' own keys. Two sizes, so that a batch growing or shrinking builds no new
    kernel after the warm-up built both."""
    most = max(1, PREFIX_QUERIES_PER_BLOCK // queries_per_kv_head)
    most = 1 << (most.bit_length() - 1)
    while most > 1 and (2 + dim) * (THREADS // 32) * queries_per_kv_head * most * 4 > SHARED_BYTES:
        most //= 2
    return most if rows >= most else 1


def held_prefix_decode_attention(mx, queries, prefix_keys, prefix_values, keys, values,
                                 mask, *, scale: float, lane_elements: int | None = None,
                                 rows_per_block: int | None = None):
    """The attention of ``queries`` (rows, query heads, 1, head dim) over a prefix every
    row sees, held once (``prefix_keys`` / ``prefix_values``: 1, KV heads, prefix, head
    dim), followed by each row's own keys and values as ``masked_decode_attention``
    reads them under ``mask``; as if each row held the prefix in front of its own keys.
    The same two launches: the prefix's blocks and the rows' own are one grid, merged
    alike. A block over a span of the prefix computes ``rows_per_block`` rows' queries
    (default ``held_rows_per_block``), each key loaded once for them all; ``lane_elements``
    is for the rows' own keys, the prefix's blocks take ``elements_per_lane`` of their
    queries. CUDA only; the caller checks ``held_kernel_applies`` first."""
    rows, q_heads, _, dim = queries.shape
    rep = q_heads // keys.shape[1]
    group = rows_per_block or held_rows_per_block(dim, rep, rows)
    if (group < 1 or group & (group - 1) or group * rep > MOST_PREFIX_QUERIES
            or (2 + dim) * (THREADS // 32) * rep * group * 4 > SHARED_BYTES):
        raise ValueError(f"rows_per_block must be a power of two whose queries fit a "
                         f"block ({MOST_PREFIX_QUERIES} and {SHARED_BYTES} bytes of shared "
                         f"memory at most), not {group}")
    prefix_splits = -(-prefix_keys.shape[2] // KEYS_PER_SPLIT)
    own_splits = -(-mask.shape[-1] // KEYS_PER_SPLIT)
    blocks = prefix_splits * -(-rows // group) + own_splits * rows
    return _split_and_merged(
        mx, "held_split", [queries, prefix_keys, prefix_values, keys, values, mask],
        grid=(blocks, 1), splits=prefix_splits + own_splits, scale=scale,
        lane_elements=lane_elements,
        template=[("ROWS", group), ("HELD_EPL", elements_per_lane(dim, rep * group))])


def _split_and_merged(mx, kernel: str, inputs: list, *, grid: tuple[int, int], splits: int,
                      scale: float, lane_elements: int | None, template: list = ()):
    """The first kernel ``kernel`` over a grid of ``grid`` (blocks along the keys, along
    the rows) blocks per KV head, each of ``splits`` splits a row's, then the merge."""
    queries, keys = inputs[0], inputs[-3]
    rows, q_heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    rep = q_heads // kv_heads
    lane_elements = lane_elements or elements_per_lane(dim, rep)
    if lane_elements * 32 < dim or dim % lane_elements or lane_elements & (lane_elements - 1):
        raise ValueError(f"lane_elements must be a power of two from {dim // 32} to "
                         f"{dim}, not {lane_elements}")
    kernels = _made(mx)
    scale_bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    split_values, split_top, split_total = getattr(kernels, kernel)(
        inputs=inputs,
        template=[("T", queries.dtype), ("D", dim), ("REP", rep), ("EPL", lane_elements),
                  ("SCALE_BITS", scale_bits), ("THREADS", THREADS),
                  ("KEYS_PER_LOAD", KEYS_PER_LOAD), ("KEYS_PER_SPLIT", KEYS_PER_SPLIT),
                  *template],
        grid=(grid[0] * THREADS, kv_heads, grid[1]),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, q_heads, splits, dim), (rows, q_heads, splits),
                       (rows, q_heads, splits)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    (attended,) = kernels.merge(
        inputs=[split_values, split_top, split_total], template=[("T", queries.dtype)],
        grid=(dim, q_heads, rows), threadgroup=(dim, 1, 1),
        output_shapes=[(rows, q_heads, 1, dim)], output_dtypes=[queries.dtype])
    return attended
