"""A decode step's attention under an array mask on MLX's CUDA backend: our kernel or the grouped products.

Owns ``decode_attention``, which the engine's decode paths (``runtime.compiled_decode``,
``runtime.mixed_step``) call for each layer of a decode step (one query a row), and
``install_masked_decode`` (``--decode-attention kernel`` or ``grouped``), which the
engine calls before its first step (``runtime.engine.loading.make_engine_core``). It
receives a layer's queries, its ``BatchKVCache`` and mlx-lm's mask, and returns the
attention, or None where the caller should keep MLX's own; nothing else. The kernel is
``runtime.cuda_masked_decode``'s; the grouped products, and the wrapper the route is
installed on, are ``runtime.cuda_attention``'s. A layer holding its rows' shared prefix
once (``runtime.held_prefix``) goes to the kernel's variant over a held prefix where the
kernel is installed and applies, and on every other backend or shape to
``runtime.shared_prefix_attention``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from runtime.cuda_attention import KEY_ALIGNMENT, grouped_attention, installed_attention
from runtime.cuda_masked_decode import (
    held_kernel_applies,
    held_prefix_decode_attention,
    held_rows_per_block,
    kernel_applies,
    masked_decode_attention,
)
from runtime.held_prefix import held_prefix
from runtime.shared_prefix_attention import shared_prefix_attention

log = logging.getLogger(__name__)

# ``decode_attention`` gives a step the grouped products only where a layer's keys and
# values as MLX's fallback reads them (once per query head) come to at least this many
# bytes (``--decode-grouped-min-mib``); below it a step is bound by its host, and the
# grouped products' operations cost the host more than they save the device (an H100,
# Qwen3-0.6B's shape: 2 and 4 rows at 12k, 4 at 4k and 16 at 2k were 0.5-2.9 ms a step
# slower grouped than under the fallback, bench/decode_memory.py), so those steps go to
# our kernel or the fallback. On that shape 512 MiB is 65,536 keys over the batch's rows
# (16 rows at 4k, 4 at 16k).
DECODE_GROUPED_MIN_BYTES = 512 << 20
# ``install_masked_decode``'s routes below the grouped products' bound: our kernel where
# it applies, or MLX's fallback.
MASKED_DECODE_MODES = ("kernel", "grouped")


class _KeptDecodeMask(threading.local):
    """The last decode mask ``decode_attention`` widened on this thread, and its source."""

    source: Any = None
    n_keys: int = 0
    mask: Any = None


_kept_decode_mask = _KeptDecodeMask()


def decode_attention(mx, queries, cache, *, scale, mask):
    """A decode step's attention for ``queries`` (one a row) over ``cache`` (a
    ``BatchKVCache`` layer, this step's keys already in it) under mlx-lm's boolean
    ``mask`` (rows, 1, 1, keys); None where the caller should keep MLX's own: no route
    installed (``install_masked_decode``), no array mask, not half precision, or another
    cache. A layer holding its rows' shared prefix once (``runtime.held_prefix``) goes to
    ``held_prefix_decode_attention`` (our kernel's two launches, the prefix read once
    from memory for all rows) where the kernel is installed and applies, else to
    ``shared_prefix_attention`` (about 30 operations a layer, which on an H100 made four
    12k-token sessions' decode step 10 ms slower than our kernel's) on any backend.

    A step whose layers MLX's fallback would read at least the ``min_bytes`` it was
    installed with goes as ``grouped_attention`` computes it over the cache's buffer up
    to its length rounded up to ``KEY_ALIGNMENT`` (the keys past its end masked, and the
    buffer grown with zeros first where it is shorter). A shallower one, installed as
    ``kernel``, goes through ``masked_decode_attention`` (one kernel of ours and its
    reduction, the buffers read in place) where ``kernel_applies``; else to MLX.

    Why: MLX's CUDA kernel for one query a row takes no array mask, and mlx-lm gives a
    decoding batch one (its rows are padded on the left to one length). MLX's fallback
    then runs several operations a layer and reads every KV head's keys and values once
    for each of its query heads. The grouped products read them once, and over an
    aligned number of keys the products stay on the GPU's fast matrix kernels, but they
    are as many operations: on an H100, 16 rows at 12k tokens of context, Qwen3-0.6B's
    shape (two query heads a KV head), the whole decode step took 31 ms under MLX's
    fallback and 10.8 ms grouped, while steps of 2-4 rows at 12k took 11-13 ms either way,
    bound by the host (``bench/decode_memory.py``). The kernel reads them once in two
    launches: 4 rows at 12k took 6.1-7.1 ms a step against 8.7-10.0 under the fallback,
    while 16 rows at 12k took 16.8 ms against 10.4 grouped."""
    attention = mx.fast.scaled_dot_product_attention
    held = held_prefix(cache)
    if held is not None:  # on every backend: MLX's own would miss the prefix
        if getattr(attention, "held_kernel", False) and queries.shape[2] == 1:
            # One row with no padding left has no mask (runtime.plain_masks): all of
            # its own keys are visible.
            own = mask if isinstance(mask, mx.array) else _every_key_visible(
                mx, queries.shape[0], cache._idx)
            if held_kernel_applies(mx, queries, *held, cache.keys, cache.values, own):
                return held_prefix_decode_attention(mx, queries, *held, cache.keys,
                                                    cache.values, own, scale=scale)
        keys, values = cache.keys_and_values()
        return shared_prefix_attention(mx, queries, *held, keys, values, scale=scale,
                                       mask=mask)
    if (not getattr(attention, "grouped_decode", False)
            or not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 4
            or queries.shape[2] != 1 or queries.dtype not in (mx.bfloat16, mx.float16)
            or type(cache).__name__ != "BatchKVCache" or cache.keys is None):
        return None
    if mask.shape[-1] != cache._idx:
        return None
    end = cache._idx
    rows, kv_heads = cache.keys.shape[0], cache.keys.shape[1]
    once = rows * end * kv_heads * (cache.keys.shape[3] + cache.values.shape[3])
    if once * cache.keys.dtype.size * (queries.shape[1] // kv_heads) < (
            attention.grouped_decode_min_bytes):
        if getattr(attention, "decode_kernel", False) and kernel_applies(
                mx, queries, cache.keys, cache.values, mask):
            return masked_decode_attention(mx, queries, cache.keys, cache.values, mask,
                                           scale=scale)
        return None
    n_keys = -(-end // KEY_ALIGNMENT) * KEY_ALIGNMENT
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


class _KeptFullMask(threading.local):
    """The last mask ``_every_key_visible`` made on this thread: a step's layers share it."""

    shape: tuple = ()
    mask: Any = None


_kept_full_mask = _KeptFullMask()


def _every_key_visible(mx, rows: int, n_keys: int):
    """A decode step's boolean mask (rows, 1, 1, keys) with every key visible."""
    kept = _kept_full_mask
    if kept.shape != (rows, n_keys):
        kept.shape, kept.mask = (rows, n_keys), mx.ones((rows, 1, 1, n_keys), dtype=mx.bool_)
    return kept.mask


def install_masked_decode(mx, mode: str, min_bytes: int = DECODE_GROUPED_MIN_BYTES) -> bool:
    """Let ``decode_attention`` compute a decode step's masked attention in this process,
    on CUDA only (MLX's Metal kernel for one query a row takes the mask itself): the
    grouped products in steps whose layers MLX's fallback would read at least
    ``min_bytes`` of, and below that our kernel (``mode`` "kernel") where it applies;
    whether it did.
    Idempotent; a later call sets the mode again."""
    if mode not in MASKED_DECODE_MODES:
        raise ValueError(f"mode must be one of {MASKED_DECODE_MODES}, not {mode!r}")
    current = installed_attention(mx)
    if current is None:
        return False
    current.grouped_decode = True
    current.decode_kernel = current.held_kernel = mode == "kernel"
    current.grouped_decode_min_bytes = min_bytes
    return True


def warm_masked_decode(mx, queries, keys, values, *, scale: float) -> bool:
    """Where our kernel is installed and applies to a layer's decode shapes (``queries``,
    ``keys`` and ``values`` of a step of at least two rows), build it (NVRTC, once per
    shape and scale, kept in MLX's kernel cache) and run it once on a one-key mask, so
    that the first masked decode step does not wait for the build, and its variant over
    a prefix held once alike; whether the first ran. A kernel that fails to build turns
    the kernel route off in this process (the grouped products and MLX's fallback stay),
    and the variant its own route (``shared_prefix_attention`` stays), logged."""
    attention = mx.fast.scaled_dot_product_attention
    if not getattr(attention, "decode_kernel", False):
        return False
    mask = mx.ones((queries.shape[0], 1, 1, 1), dtype=mx.bool_)
    if queries.shape[0] < 2 or not kernel_applies(mx, queries, keys, values, mask):
        return False
    try:
        mx.eval(masked_decode_attention(mx, queries, keys, values, mask, scale=scale))
    except Exception as exc:  # the route off, the engine up
        log.warning("the masked decode kernel did not build or run (%s: %s); a masked "
                    "decode step goes as --decode-attention grouped",
                    type(exc).__name__, exc)
        attention.decode_kernel = attention.held_kernel = False
        return False
    prefix_keys, prefix_values = keys[:1, :, :1], values[:1, :, :1]
    rep = queries.shape[1] // keys.shape[1]
    try:  # both sizes of its prefix's blocks: a row each, and several where there are
        for group in sorted({1, held_rows_per_block(queries.shape[3], rep, 1 << 30)}):
            mx.eval(held_prefix_decode_attention(mx, queries, prefix_keys, prefix_values,
                                                 keys, values, mask, scale=scale,
                                                 rows_per_block=group))
    except Exception as exc:  # the held route's kernel off, the other stays
        log.warning("the held-prefix decode kernel did not build or run (%s: %s); a layer "
                    "holding its rows' prefix once goes as runtime.shared_prefix_attention",
                    type(exc).__name__, exc)
        attention.held_kernel = False
    return True
