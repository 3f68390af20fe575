"""Attention on MLX's CUDA backend: where a prefill's and a decode step's calls go.

Owns ``unfused_prefill_attention`` (a wrapper around
``mx.fast.scaled_dot_product_attention``), ``grouped_attention`` (attention as two
matrix products, each KV head's keys read once), ``ChunkAttention`` (a paced chunk's
attention read in place from its cache) and ``install_prefill_attention``
(``--prefill-attention unfused``, the default), which the engine calls before its first
step (``runtime.engine.loading.make_engine_core``, on its thread or in its process). A
decode step's attention under an array mask is ``runtime.cuda_decode_attention``'s. They
receive the engine's attention calls and return their outputs; nothing else.

A prefill's attention goes to unfused attention instead of cuDNN:

* MLX's CUDA backend runs attention through a cuDNN graph built for the exact shapes and
  strides of the call and kept in an LRU cache. A prefill step of a shape not seen
  before (its group size, prompt length, cached prefix) builds one on the engine's
  thread before the step can run. Measured on an H200 (docs/performance.md, "Prefill
  attention and cuDNN graphs"): a prefill of one 100-400-token prompt took 62-89 ms
  (medians) the first time against 12-17 ms once cached, some shapes 0.9-8 s; a server
  meets new shapes with nearly every prompt. Through MLX's unfused attention (its own
  fallback: matmuls and a softmax, no graph to build) the same prefills took 19-31 ms
  the first time and 14 ms after.
* The wrapper computes that attention itself (``grouped_attention``): two matrix
  products in the inputs' precision around a float32 softmax, as MLX's own fallback
  does, with each KV head's query heads folded into its rows so the keys and values are
  read once per KV head. A query longer than one token whose scores stay small (at most
  ``UNFUSED_SCORES_LIMIT`` elements) goes this way; beyond it a fresh prompt keeps cuDNN
  (its attention outruns the products by more than a graph build).
* A chunk of at most ``UNFUSED_CHUNK_QUERIES`` queries that continues a cached prefix (a
  paced chunk, a coding agent's next turn, a long prompt's last, odd-sized chunk) has a
  shape of its own nearly every time, since the prefix grows by each chunk: through
  cuDNN a paced 30k-token prefill's chunks took 115-1,160 ms where those under the limit
  took 40 (a graph per step). Those go the same way, their queries in blocks whose
  scores stay within ``UNFUSED_BLOCK_LIMIT`` elements, each block against the keys up to
  its last query (the causal mask unchanged): no graph builds and bounded memory at any
  prefix length (under an array mask, where every block meets every key, the keys are
  aligned and the mask made once for all blocks: ``grouped_in_blocks``).
  ``bench/paced_step.py`` on an H200 (Qwen3-0.6B shape,
  docs/performance.md): a step with a 64-token chunk at 24k took 61 ms this way, 99
  through MLX's fallback (a float32 query, which cuDNN does not take) and 132 through
  cuDNN; one prompt's 1,776-token chunk at 22.5k took 219 ms this way against 290
  through cuDNN at a new shape and 254 with its graph built, and a 4,096-token one 579
  against 896 and 776.
* A fresh prompt's full chunks (more than ``RECURRING_CHUNK_QUERIES`` queries, the
  prefix a whole number of chunks) keep cuDNN, with their keys made contiguous: their
  shapes recur from prompt to prompt, so each graph is built once, and with it built
  cuDNN outruns the grouped products at depth. Every prefill call that reaches cuDNN
  gets contiguous keys, so that its graph follows the call's shapes and not the length
  of the buffer it was read from.
* A lone prompt's odd-sized chunk (under the causal mask, more than
  ``PADDED_TAIL_SHARE``'s share of a full chunk) that starts or ends at a whole number
  of chunks goes to cuDNN padded to a full chunk, whose graph it shares.

A decode step (one query token a row) meets few shapes and keeps MLX's kernel, except
under an array mask (a batch of rows), which that kernel does not take: the engine's
decode paths (``runtime.compiled_decode``, ``runtime.mixed_step``) send such a step to
``decode_attention`` (``runtime.cuda_decode_attention``), the grouped products over the
cache's buffer.
"""

from __future__ import annotations

import math
import threading
from typing import Any

# Scores of at most this many elements (batch x query heads x query x keys) go
# unfused: one 1024-token prompt with 32 heads, a group of eight 360-token prompts.
# On an H200 past it (float32 scores, before grouped_attention), a 4096-token prompt
# took 155 ms unfused against 80-90 through cuDNN's cached graph (134 uncached).
UNFUSED_SCORES_LIMIT = 1 << 25

# A chunk of at most this many queries after a cached prefix goes unfused in blocks
# of queries whose scores have at most UNFUSED_BLOCK_LIMIT elements (256 MiB in
# bfloat16: 524 queries of 16 heads against a 16k-token prefix): twice the default
# --prefill-step-size, so that a chunk after a cached prefix goes this way. On an
# H200 (bench/paced_step.py, one prompt) the grouped products beat cuDNN at 1,024 to
# 4,096 queries after 22.5k tokens, even where cuDNN's graph was already built, and
# matched it after 4k (102-282 ms against 80-266 built, 118-345 at a new shape).
UNFUSED_CHUNK_QUERIES = 4096
UNFUSED_BLOCK_LIMIT = 1 << 27

# Except a chunk of more than this many queries whose prefix is a whole number of
# chunks of its length: a fresh prompt's full --prefill-step-size chunks. Their shapes
# recur from prompt to prompt, and their keys go to cuDNN contiguous (a copy of the
# prefix: a few milliseconds over a 32k prompt), so each graph is built once for the
# server's life, and its kernel then outruns the grouped products: on an H200
# (Qwen3-0.6B shape) the bare engine's 2,048-query chunks of cold 32k prompts after
# 10k-26k tokens took 109-209 ms through cuDNN against 162-319 through the grouped
# products, and a lone prompt's, under the causal mask (runtime.mlx_lm_batches), 17-40.
RECURRING_CHUNK_QUERIES = 1024

# A lone prompt's odd-sized chunk of more than a quarter of a full chunk goes to cuDNN
# as a full chunk where its prefix is a whole number of chunks (its last chunk, or a
# fresh prompt under one chunk: queries and keys padded at the end, the padding's
# queries seeing only padding past the real keys under the causal mask aligned to the
# last key) or where its end is (a chunk that brings a prompt's prefix back to whole
# chunks, runtime.engine.pacing: its queries padded at the front, seeing the prefix's
# real keys). The padding's outputs are dropped; the shape is a full chunk's, its graph
# built once, where each prompt length would build its own. On an H200 (Qwen3-0.6B
# shape) a cold 32k prompt's last chunk of 1,295 queries took 171-202 ms through the
# grouped products and 45-51 padded; at a quarter of a chunk the grouped products
# cost about what a full chunk does through cuDNN at 24k-30k of context
# (bench/chunk_attention.py). A paced chunk of 1,024 tokens that a shared pass's
# in-place attention declines (a deep prefix) takes this path too on the grid, and
# builds that full chunk's graph once for the server's life, unless a prompt did.
PADDED_TAIL_SHARE = 4

PREFILL_ATTENTION_MODES = ("unfused", "mlx")
DECODE_ATTENTION_MODES = ("kernel", "grouped", "mlx")


def unfused_prefill_attention(
    fused,
    mx,
    limit: int = UNFUSED_SCORES_LIMIT,
    block_limit: int = UNFUSED_BLOCK_LIMIT,
    block_queries: int = UNFUSED_CHUNK_QUERIES,
    recurring_queries: int = RECURRING_CHUNK_QUERIES,
    scores: str = "half",
    full_chunk: int | None = None,
    prefill: bool = True,
):
    """``fused`` (``mx.fast.scaled_dot_product_attention``) with a prefill's calls
    sent to unfused attention (``prefill``); every other call as it was. ``scores``:
    "float32" (MLX's fallback, reached through a float32 query) or "half"
    (``grouped_attention`` in the inputs' precision). ``full_chunk``: the prefill's
    chunk length (--prefill-step-size), for padding a lone prompt's last chunk to it
    (None: no padding). ``full_chunk``, ``prefill`` and ``grouped_decode`` (whether
    ``decode_attention`` applies) are the returned function's attributes of those
    names, which later installs set."""
    half = (mx.bfloat16, mx.float16)

    def unfused(queries, keys, values, **kwargs):
        if scores == "half" and kwargs.get("sinks") is None:
            grouped = grouped_attention(mx, queries, keys, values, **kwargs)
            if grouped is not None:
                return grouped
        out = fused(queries.astype(mx.float32), keys, values, **kwargs)
        return out.astype(queries.dtype)

    def in_blocks(queries, keys, values, *, mask=None, **kwargs):
        """Blocks of queries; with a causal mask each block meets only the keys up to
        its last query, an array mask is cut to each block's queries."""
        n_queries, n_keys = queries.shape[2], keys.shape[2]
        rows = queries.size // (queries.shape[3] * n_queries)  # batch x heads
        block = max(1, block_limit // (rows * n_keys))
        if scores == "half" and kwargs.get("sinks") is None:
            every = grouped_in_blocks(mx, queries, keys, values, mask=mask, block=block,
                                      scale=kwargs["scale"])
            if every is not None:
                return every
        outputs = []
        for start in range(0, n_queries, block):
            end = min(n_queries, start + block)
            seen, block_mask = n_keys, mask
            if isinstance(mask, str):  # "causal": later keys are masked for this block
                seen = n_keys - (n_queries - end)
            elif mask is not None and mask.shape[-2] > 1:
                block_mask = mask[..., start:end, :]
            outputs.append(unfused(queries[:, :, start:end], keys[:, :, :seen],
                                   values[:, :, :seen], mask=block_mask, **kwargs))
        return mx.concatenate(outputs, axis=2)

    def padded_to_full(queries, keys, values, full, **kwargs):
        """A lone prompt's chunk through ``fused`` as a full chunk (``PADDED_TAIL_SHARE``):
        at a prefix of whole chunks, queries and keys padded at the end; else (its end
        at whole chunks) its queries at the front. The real queries' outputs kept."""
        n_queries, pad = queries.shape[2], full - queries.shape[2]
        if (keys.shape[2] - n_queries) % full:
            queries = mx.pad(queries, [(0, 0), (0, 0), (pad, 0), (0, 0)])
            return fused(queries, mx.contiguous(keys), mx.contiguous(values), **kwargs)[:, :, pad:]
        widths = [(0, 0), (0, 0), (0, pad), (0, 0)]
        out = fused(mx.pad(queries, widths), mx.pad(keys, widths), mx.pad(values, widths),
                    **kwargs)
        return out[:, :, :n_queries]

    def attention(queries, keys, values, *args, **kwargs):
        if (attention.prefill and queries.ndim == 4 and queries.shape[2] > 1
                and queries.dtype in half and not args):
            elements = queries.size // queries.shape[3] * keys.shape[2]
            if elements <= limit:
                return unfused(queries, keys, values, **kwargs)
            n_queries, n_keys = queries.shape[2], keys.shape[2]
            full, mask = attention.full_chunk, kwargs.get("mask")
            if (full is not None and isinstance(mask, str) and mask == "causal"
                    and kwargs.get("sinks") is None
                    and full // PADDED_TAIL_SHARE < n_queries < full
                    and ((n_keys - n_queries) % full == 0 or n_keys % full == 0)):
                return padded_to_full(queries, keys, values, full, **kwargs)
            recurring = n_queries > recurring_queries and (n_keys - n_queries) % n_queries == 0
            if n_queries < n_keys and n_queries <= block_queries and not recurring:
                return in_blocks(queries, keys, values, **kwargs)  # a paced chunk
            # To cuDNN, whose graphs are keyed by the inputs' strides as well as their
            # shapes: read from a prompt batch's buffer (sized to the whole prompt), the
            # keys' strides follow the prompt's length, so a graph would be built for
            # every chunk of every new length. Contiguous, they follow the chunk alone,
            # and a full chunk's graph is a padded last chunk's (padding makes them so).
            queries = mx.contiguous(queries)
            keys, values = mx.contiguous(keys), mx.contiguous(values)
        return fused(queries, keys, values, *args, **kwargs)

    attention.fused = fused
    attention.half_scores = scores == "half"
    attention.full_chunk = full_chunk
    attention.prefill = prefill
    attention.grouped_decode = False  # ``install_masked_decode`` sets these three
    attention.decode_kernel = False
    attention.grouped_decode_min_bytes = 0
    # Whether a prefill's attention is the grouped one (``chunk_attention`` reads this).
    attention.grouped = attention.half_scores and prefill
    return attention


# Keys are padded to a multiple of this many (masked out): a product whose rows are
# of another length leaves the GPU's fast matrix kernels. On an H200, paced steps whose
# keys numbered 64k + 61 took 2-2.5x as long at 10k-20k tokens of context as those
# with 64k.
KEY_ALIGNMENT = 64


def grouped_attention(mx, queries, keys, values, *, scale, mask=None, sinks=None,
                      visible_keys: int = 0, align: bool = True, prepared: bool = False):
    """Attention as two matrix products in the inputs' precision around a float32
    softmax, as MLX's own fallback computes it, with each KV head's query heads folded
    into its query rows: one strided batch of products, each KV head's keys and values
    read once for all its query heads, and the keys padded to ``KEY_ALIGNMENT`` (the
    padding masked out). None for a mask of a shape it does not take (the caller then
    uses MLX's fallback). ``visible_keys``: the first this many keys are visible to
    every query (a boolean mask all true there), so only the scores after them are
    masked, written back in place: at 30k keys of context the mask's pass over every
    score was as costly as the first product (bench/chunk_attention.py). ``align``: False
    leaves the keys as they are (``decode_attention``'s are aligned already).
    ``prepared``: the mask, keys and values are ``_prepared``'s already."""
    if not prepared:
        made = _prepared(mx, queries, keys, values, mask, align=align)
        if made is None:
            return None
        mask, keys, values = made
    batch, heads, length, dim = queries.shape
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows = (queries * scale).reshape(batch, kv_heads, group * length, dim)
    products = (rows @ keys.swapaxes(-1, -2)).reshape(batch, kv_heads, group, length, n_keys)
    if mask is not None and mask.dtype == mx.bool_:
        # The lowest finite value, not -inf: a padded row that sees no key gets an
        # even spread rather than NaN, which its zero weights would carry on.
        lowest = mx.finfo(products.dtype).min
        if visible_keys:
            products[..., visible_keys:] = mx.where(
                mask[..., visible_keys:], products[..., visible_keys:], lowest)
        else:
            products = mx.where(mask, products, lowest)
    elif mask is not None:
        products = products + mask.astype(products.dtype)
    weights = mx.softmax(products, axis=-1, precise=True)
    out = weights.reshape(batch, kv_heads, group * length, n_keys) @ values
    return out.reshape(batch, heads, length, values.shape[-1])


_UNTAKEN = object()  # a mask grouped_attention does not take


def grouped_in_blocks(mx, queries, keys, values, *, scale, mask, block: int):
    """``grouped_attention`` in blocks of ``block`` queries, the keys aligned and the
    mask made once for all blocks, not once a block (each a copy of the prefix: eight
    user turns after a shared 12.5k-token prompt, Qwen3-0.6B's shape, are six blocks a
    layer of 400 MB). Under no mask or an array mask every block meets every key; under
    ``"causal"`` (``causal_in_blocks``) each meets the keys up to its last query. None
    for a mask it does not take."""
    if isinstance(mask, str):
        return causal_in_blocks(mx, queries, keys, values, scale=scale, block=block) \
            if mask == "causal" else None
    length = queries.shape[2]
    made = _prepared(mx, queries, keys, values, mask)
    if made is None:
        return None
    made, keys, values = made
    per_query = made is not None and made.ndim >= 2 and made.shape[-2] == length
    return mx.concatenate([grouped_attention(
        mx, queries[:, :, start:start + block], keys, values, scale=scale, prepared=True,
        mask=made[..., start:start + block, :] if per_query else made)
        for start in range(0, length, block)], axis=2)


def causal_in_blocks(mx, queries, keys, values, *, scale, block: int):
    """Attention under the causal mask (aligned to the last key, as MLX's ``"causal"``)
    in blocks of ``block`` queries: the keys and values aligned once, each block's
    products over the aligned keys up to its last query (a view), and only the scores
    past the keys every query of the block sees masked (``visible_keys``). The rows of a
    batch share the mask: a batch of prompts with no left padding (a wave of sessions
    after one cached system prompt, ``runtime.plain_masks``) takes it as a lone prompt
    does."""
    n_queries, n_keys = queries.shape[2], keys.shape[2]
    keys, values = _padded_keys(mx, keys, values, -n_keys % KEY_ALIGNMENT)
    first = n_keys - n_queries  # the first query's position among the keys
    positions = mx.arange(first, n_keys)
    outputs = []
    for start in range(0, n_queries, block):
        end = min(n_queries, start + block)
        # The padding's keys lie past every query's position: masked with the later keys.
        seen = -(-(first + end) // KEY_ALIGNMENT) * KEY_ALIGNMENT
        visible = (first + start + 1) // KEY_ALIGNMENT * KEY_ALIGNMENT
        mask = positions[start:end, None] >= mx.arange(seen)[None]
        outputs.append(grouped_attention(
            mx, queries[:, :, start:end], keys[:, :, :seen], values[:, :, :seen],
            scale=scale, mask=mask, visible_keys=visible, prepared=True))
    return mx.concatenate(outputs, axis=2)


def _prepared(mx, queries, keys, values, mask, *, align: bool = True):
    """``mask`` in ``grouped_attention``'s layout (``_key_mask``) and the keys and values
    padded to ``KEY_ALIGNMENT`` where ``align``; None for a mask it does not take."""
    heads, length, n_keys = queries.shape[1], queries.shape[2], keys.shape[2]
    padding = -n_keys % KEY_ALIGNMENT if align else 0
    made = _key_mask(mx, mask, heads=heads, kv_heads=keys.shape[1], length=length,
                     n_keys=n_keys, padding=padding, dtype=queries.dtype)
    if made is _UNTAKEN:
        return None
    keys, values = _padded_keys(mx, keys, values, padding)
    return made, keys, values


def _padded_keys(mx, keys, values, padding: int):
    """``keys`` and ``values`` with ``padding`` zero positions after their last."""
    if not padding:
        return keys, values
    widths = [(0, 0), (0, 0), (0, padding), (0, 0)]
    return mx.pad(keys, widths), mx.pad(values, widths)


# Masks of at most this many elements are kept for the next layer (``_key_mask``).
KEPT_MASK_ELEMENTS = 1 << 24


class _KeptMask(threading.local):
    """The last mask ``_key_mask`` made on this thread, with what it was made from."""

    source: Any = None
    key: tuple = ()
    mask: Any = None


_kept_mask = _KeptMask()


def _key_mask(mx, mask, *, heads, kv_heads, length, n_keys, padding, dtype):
    """``mask`` (None, "causal", boolean or additive, per head or for all) in the layout
    of ``grouped_attention``'s products, over the keys and their ``padding``; _UNTAKEN
    for one it does not take. A model's layers each get the same mask in a forward pass:
    the last one made on this thread is handed out again for the same source, so that
    the pass builds it once, not once per layer."""
    key = (length, n_keys, padding, heads, kv_heads, dtype)
    kept = _kept_mask
    if kept.key == key and (kept.source is mask or (
            isinstance(mask, str) and isinstance(kept.source, str) and kept.source == mask)):
        return kept.mask
    source, group = mask, heads // kv_heads
    if isinstance(mask, str):
        if mask != "causal":
            return _UNTAKEN
        mask = mx.arange(n_keys - length, n_keys)[:, None] >= mx.arange(n_keys)[None]
    elif mask is not None:
        if mask.ndim == 4 and mask.shape[1] == 1:
            mask = mask[:, :, None]
        elif mask.ndim == 4 and mask.shape[1] == heads:
            mask = mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])
        elif mask.ndim > 2:
            return _UNTAKEN
    if padding:
        # The padding gets -inf, a masked key the lowest finite value: a row that sees
        # no key still spreads its weight over the real keys only (as below).
        if mask is None:
            mask = mx.zeros((n_keys,), dtype=dtype)
        elif mask.dtype == mx.bool_:
            mask = mx.where(mask, 0, mx.finfo(dtype).min).astype(dtype)
        mask = mx.broadcast_to(mask, (*mask.shape[:-1], n_keys))
        mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, padding)], constant_values=-mx.inf)
    if mask is not None and mask.size <= KEPT_MASK_ELEMENTS:
        kept.source, kept.key, kept.mask = source, key, mask
    return mask


class ChunkAttention:
    """A prefill chunk's attention read from its batch KV cache's buffer, for the
    layers of one forward pass (``runtime.mixed_step``): the keys and values up to the
    cache's length rounded up to ``KEY_ALIGNMENT``, sliced from the buffer with no copy
    (mlx-lm allocates it zeroed, in blocks of 256 tokens or more; past the cache's end it
    may also hold a padded chunk's keys, ``runtime.mixed_step.tail_padding``: finite,
    and masked like the zeros), and one boolean mask
    for every layer that hides the keys past the chunk's end as it hides later keys.
    The same attention as ``grouped_attention`` over the cache's keys, without
    padding and masking the whole prefix anew in every layer."""

    def __init__(self, mx, *, prefix: int, length: int, left_padding):
        self.mx = mx
        self.n_keys = -(-(prefix + length) // KEY_ALIGNMENT) * KEY_ALIGNMENT
        keys = mx.arange(self.n_keys)
        causal = mx.arange(prefix, prefix + length)[:, None] >= keys[None]
        self.mask = causal & (left_padding.reshape(-1, 1, 1, 1) <= keys)
        # One row with no padding sees the whole prefix: only the chunk's own keys
        # (from the aligned block it starts in) are masked.
        lone = left_padding.size == 1 and not left_padding.item()
        self.visible_keys = prefix // KEY_ALIGNMENT * KEY_ALIGNMENT if lone else 0

    def __call__(self, queries, cache, *, scale):
        """The chunk's attention in ``cache`` (its keys already updated), or None where
        the buffer is shorter than the aligned keys."""
        if cache.keys.shape[2] < self.n_keys:
            return None
        keys = cache.keys[..., : self.n_keys, :]
        values = cache.values[..., : self.n_keys, :]
        return grouped_attention(self.mx, queries, keys, values, scale=scale, mask=self.mask,
                                 visible_keys=self.visible_keys)


def in_place_chunk_limit(mx, *, heads: int, rows: int, prefix: int) -> int | None:
    """The most tokens a shared pass's chunk of ``rows`` prompts after ``prefix`` keys may
    have for ``chunk_attention`` to read its attention in place (its scores within
    ``UNFUSED_BLOCK_LIMIT``); None where the grouped attention is not installed (no
    such bound). A longer chunk takes the installed attention in blocks of queries,
    each padding and copying the prefix's keys: on an H200 (Qwen3-0.6B shape, 16
    query heads), 512-token paced chunks beyond 16k tokens of context took 67-117 ms
    beside 16 streams, against 30-45 for 256-token ones."""
    if not getattr(mx.fast.scaled_dot_product_attention, "grouped", False):
        return None
    budget = UNFUSED_BLOCK_LIMIT // max(1, rows * heads)
    reach = prefix + KEY_ALIGNMENT
    length = int((math.sqrt(reach * reach + 4 * budget) - reach) / 2)
    while length > 0 and length * (reach + length) > budget:
        length -= 1
    while (length + 1) * (reach + length + 1) <= budget:
        length += 1
    return length


def chunk_attention(mx, cache, *, length: int, heads: int, dtype) -> ChunkAttention | None:
    """A ``ChunkAttention`` for a ``length``-token chunk about to be added to ``cache``
    (a ``BatchKVCache`` layer, before its update), where the prefill attention is the
    grouped one (``install_prefill_attention``), the queries are in half precision and
    the scores stay within ``UNFUSED_BLOCK_LIMIT``; None where the chunk's attention
    should take the installed path as it is."""
    if dtype not in (mx.bfloat16, mx.float16) or length < 2:
        return None
    prefix = cache._idx
    limit = in_place_chunk_limit(mx, heads=heads, rows=len(cache.left_padding), prefix=prefix)
    if limit is None or length > limit:
        return None
    return ChunkAttention(mx, prefix=prefix, length=length, left_padding=cache.left_padding)


def install_prefill_attention(mx, full_chunk: int | None = None) -> bool:
    """Route prefill attention to MLX's unfused path in this process, on CUDA only
    (MLX's Metal kernels build no per-shape graphs); whether it did. Idempotent; the
    latest call's ``full_chunk`` (``unfused_prefill_attention``) stands."""
    current = installed_attention(mx)
    if current is None:
        return False
    current.full_chunk = full_chunk
    current.prefill = True
    current.grouped = current.half_scores
    return True


def installed_attention(mx):
    """``mx.fast.scaled_dot_product_attention`` wrapped by ``unfused_prefill_attention``
    (at first with no route on); None off CUDA."""
    if not mx.cuda.is_available():
        return None
    current = mx.fast.scaled_dot_product_attention
    if not hasattr(current, "fused"):
        current = mx.fast.scaled_dot_product_attention = unfused_prefill_attention(
            current, mx, prefill=False)
    return current
