"""A decode step's attention under an array mask on MLX's CUDA backend: the grouped products.

Owns ``decode_attention``, which the engine's decode paths (``runtime.compiled_decode``,
``runtime.mixed_step``) call for each layer of a decode step (one query a row), and
``install_grouped_decode`` (``--decode-attention grouped``, the default), which the
engine calls before its first step (``runtime.engine.loading.make_engine_core``). It
receives a layer's queries, its ``BatchKVCache`` and mlx-lm's mask, and returns the
attention, or None where the caller should keep MLX's own; nothing else. The grouped
products themselves, and the wrapper it is installed on, are
``runtime.cuda_attention``'s.
"""

from __future__ import annotations

import threading
from typing import Any

from runtime.cuda_attention import KEY_ALIGNMENT, grouped_attention, installed_attention

# ``decode_attention`` takes a step only where a layer's keys and values as MLX's fallback
# reads them (once per query head) come to at least this many bytes
# (``--decode-grouped-min-mib``); below it the grouped products cost the host more than
# they save the device. On Qwen3-0.6B's shape 512 MiB is 65,536 keys over the batch's
# rows (16 rows at 4k, 4 at 16k).
DECODE_GROUPED_MIN_BYTES = 512 << 20

# Under ``--decode-attention rows``, batches of at most this many rows attend row by row
# (``row_by_row``): a call and two slices a row in each layer, which a larger batch's
# host would not keep up with.
DECODE_BY_ROW_ROWS = 8


class _KeptDecodeMask(threading.local):
    """The last decode mask ``decode_attention`` widened on this thread, and its source."""

    source: Any = None
    n_keys: int = 0
    mask: Any = None


_kept_decode_mask = _KeptDecodeMask()


def decode_attention(mx, queries, cache, *, scale, mask):
    """A decode step's attention for ``queries`` (one a row) over ``cache`` (a
    ``BatchKVCache`` layer, this step's keys already in it) under mlx-lm's boolean
    ``mask`` (rows, 1, 1, keys), as ``grouped_attention`` computes it over the cache's
    buffer up to its length rounded up to ``KEY_ALIGNMENT`` (the keys past its end
    masked, and the buffer grown with zeros first where it is shorter); None where
    this does not apply: the route not installed (``install_grouped_decode``), no array
    mask, not half precision, another cache, or a step too shallow for its reads to
    outweigh the host's work (the ``min_bytes`` it was installed with). A batch of
    few rows (``by_row_rows``) goes ``row_by_row`` instead.

    Why: MLX's CUDA kernel for one query a row takes no array mask, and mlx-lm gives a
    decoding batch one (its rows are padded on the left to one length). MLX's fallback
    then reads every KV head's keys and values once for each of its query heads; the
    grouped products read them once, and over an aligned number of keys the products
    stay on the GPU's fast matrix kernels. On an H100, 16 rows at 12k tokens of
    context, Qwen3-0.6B's shape (two query heads a KV head): the whole decode step
    took 31 ms under MLX's fallback and 10.8 ms this way; the KV update and attention
    alone 9.9 ms this way, and 14 or 38 ms (alternating) with the keys unaligned
    (``bench/decode_memory.py``)."""
    installed = mx.fast.scaled_dot_product_attention
    if (not getattr(installed, "grouped_decode", False)
            or not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 4
            or queries.shape[2] != 1 or queries.dtype not in (mx.bfloat16, mx.float16)
            or type(cache).__name__ != "BatchKVCache" or cache.keys is None):
        return None
    end = cache._idx
    n_keys = -(-end // KEY_ALIGNMENT) * KEY_ALIGNMENT
    if mask.shape[-1] != end:
        return None
    rows, kv_heads = cache.keys.shape[0], cache.keys.shape[1]
    once = rows * end * kv_heads * (cache.keys.shape[3] + cache.values.shape[3])
    if once * cache.keys.dtype.size * (queries.shape[1] // kv_heads) < installed.grouped_decode_min_bytes:
        return None
    if rows <= installed.decode_by_row_rows:
        by_row = row_by_row(mx, installed.fused, queries, cache, scale=scale)
        if by_row is not None:
            return by_row
    if cache.keys.shape[2] < n_keys:  # as mlx-lm grows it: zeros at the end
        widths = [(0, 0), (0, 0), (0, n_keys - cache.keys.shape[2]), (0, 0)]
        cache.keys, cache.values = mx.pad(cache.keys, widths), mx.pad(cache.values, widths)
    kept = _kept_decode_mask
    if kept.source is not mask or kept.n_keys != n_keys:
        widened = mx.pad(mask, [(0, 0)] * 3 + [(0, n_keys - end)], constant_values=False)
        kept.source, kept.n_keys, kept.mask = mask, n_keys, widened
    return grouped_attention(mx, queries, cache.keys[..., :n_keys, :],
                             cache.values[..., :n_keys, :], scale=scale, mask=kept.mask,
                             align=False)


class _KeptPaddings(threading.local):
    """Each cache layer's left padding as a host list, with the array it was read from."""

    def __init__(self):
        self.by_layer: dict[int, tuple[Any, list[int]]] = {}


_kept_paddings = _KeptPaddings()


def _host_paddings(cache) -> list[int]:
    """``cache.left_padding`` as a list, read once for each array mlx-lm or the engine
    sets there (a join, a leave, a vacant row filled). The engine makes them on the host
    (``runtime.vacant_rows``), so the read waits for nothing."""
    kept = _kept_paddings.by_layer
    held = kept.get(id(cache))
    if held is None or held[0] is not cache.left_padding:
        if len(kept) > 4096:  # layers of batches long gone
            kept.clear()
        held = kept[id(cache)] = (cache.left_padding, cache.left_padding.tolist())
    return held[1]


def row_by_row(mx, fused, queries, cache, *, scale):
    """A decode step's attention for ``queries`` (one a row) over ``cache`` (a
    ``BatchKVCache`` layer), each row through MLX's own kernel (``fused``) with no mask,
    over its keys past its left padding, the rows' outputs concatenated; None where a
    row has no key. The kernel for one query a row reads each KV head's keys once and
    takes no mask; the price is a call and two slices a row on the host."""
    end = cache._idx
    paddings = _host_paddings(cache)
    if len(paddings) != queries.shape[0] or max(paddings) >= end:
        return None
    keys, values = cache.keys, cache.values
    return mx.concatenate([
        fused(queries[r:r + 1], keys[r:r + 1, :, pad:end, :], values[r:r + 1, :, pad:end, :],
              scale=scale)
        for r, pad in enumerate(paddings)])


def install_grouped_decode(mx, min_bytes: int = DECODE_GROUPED_MIN_BYTES,
                           by_row_rows: int = 0) -> bool:
    """Let ``decode_attention`` compute a decode step's masked attention in this process,
    on CUDA only (MLX's Metal kernel for one query a row takes the mask itself), in steps
    whose layers MLX's fallback would read at least ``min_bytes`` of; batches of at most
    ``by_row_rows`` rows row by row (``row_by_row``), larger ones grouped; whether it
    did. Idempotent."""
    current = installed_attention(mx)
    if current is None:
        return False
    current.grouped_decode = True
    current.grouped_decode_min_bytes = min_bytes
    current.decode_by_row_rows = by_row_rows
    return True
