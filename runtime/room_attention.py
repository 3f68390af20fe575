"""A lone prompt's paced chunk attended in one fused call over its whole room.

Owns ``RoomAttention`` (one chunk's attention, for every layer of one pass),
``room_attention`` (the one for a chunk about to enter a cache, or None) and
``room_tokens`` (the room a lone prompt reserves when chunks attend so). It receives
a chunk's queries and its ``BatchKVCache`` layer from ``runtime.mixed_step`` and
returns the attention's output; it emits nothing.

Why: beside decoding sequences a long prompt is prefilled in paced chunks of 64-512
tokens, and their attention reads every key before them. MLX's CUDA backend runs an
attention fused (cuDNN) only on a graph built for the inputs' exact shapes and
strides, so a chunk whose keys grow with every step goes to two matrix products
around a softmax (``runtime.mlx_environment.grouped_attention``), which write and
read the whole score matrix several times: at 20k-30k tokens of context a 256-token
chunk's step on an H100 took 3-4.5x a decode step of 16 rows, where a step's other
work is bound by the host (docs/performance.md). Here the keys are the prompt's whole
room, the buffer its cache reserved for all of it, and a mask hides what the chunk
may not see (the keys after each query's own, the room not written yet): the shapes
and strides are those of the room and the chunk's length alone, so one graph serves
every chunk of that length in every prompt with a room of that size. Rooms come in
whole ``ROOM_BLOCK``s of tokens (``room_tokens``) so that prompts of many lengths share
few. The keys past the chunk are zeros (mlx-lm allocates a cache's buffer zeroed) or a
padded chunk's keys, finite either way, and masked.

The mask is additive, in the queries' precision, made once for a pass's layers (its
first call): MLX's CUDA attention takes no boolean one. A room of a size met for the
first time is tried once on zeros (``_supported``), which builds its graph; a size the
fused call cannot take falls back to the grouped products for the process's life,
with one warning. Half precision only (cuDNN's); any other call returns None.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# How a lone prompt's paced chunk attends (``--paced-chunk-attention``): as the
# prefill attention has it (grouped matrix products over the keys it sees, on CUDA),
# or in one fused call over its room.
PACED_CHUNK_ATTENTION_MODES = ("grouped", "room")

# A lone prompt's room, where its chunks attend over it, is a whole number of these
# tokens: rooms of nearby sizes share their attention graphs. 4,096 tokens of a
# Qwen3-0.6B-shaped cache are 0.47 GB; a prompt's room holds at most one block it
# does not use.
ROOM_BLOCK = 4096

# (chunk length, room, query heads, KV heads, head width, dtype): tried on zeros.
_tried: dict[tuple, bool] = {}


def room_tokens(needed: int, block: int) -> int:
    """The tokens a room for ``needed`` tokens holds: whole ``block``s."""
    return -(-needed // block) * block


def room_attention(mx: Any, cache: Any, *, length: int, dtype: Any) -> RoomAttention | None:
    """A ``RoomAttention`` for a ``length``-token chunk about to enter ``cache`` (a
    ``BatchKVCache`` layer of one prompt, before its update), or None where the chunk
    should attend as before: not in half precision, or of several prompts (or one
    left-padded)."""
    if dtype not in (mx.bfloat16, mx.float16) or length < 2:
        return None
    padding = cache.left_padding
    if padding.size != 1 or padding.item():
        return None
    return RoomAttention(mx, prefix=cache._idx, length=length)


class RoomAttention:
    """One chunk's attention over its cache's whole room, for every layer of a pass:
    the chunk's ``length`` queries follow ``prefix`` keys."""

    def __init__(self, mx: Any, *, prefix: int, length: int):
        self.mx = mx
        self.prefix = prefix
        self.length = length
        self._mask = None
        self._room = 0

    def mask(self, room: int, dtype: Any) -> Any:
        """(1, 1, length, room): 0 where a query sees a key (itself and every key before
        it), the lowest finite value elsewhere."""
        mx = self.mx
        if self._mask is None or self._room != room:
            keys = mx.arange(room)
            seen = mx.arange(self.prefix, self.prefix + self.length)[:, None] >= keys[None]
            lowest = mx.array(mx.finfo(dtype).min, dtype=dtype)
            self._mask = mx.where(seen, mx.array(0, dtype=dtype), lowest)[None, None]
            self._room = room
        return self._mask

    def __call__(self, queries: Any, cache: Any, *, scale: float) -> Any:
        """The chunk's attention in ``cache`` (its keys already updated), or None where
        its room is not a whole number of ``ROOM_BLOCK``s or the fused call cannot take
        it."""
        mx = self.mx
        keys, values = cache.keys, cache.values
        room = keys.shape[2]
        if room % ROOM_BLOCK or room < self.prefix + self.length:
            return None
        if not _supported(mx, queries, keys, values):
            return None
        fused = mx.fast.scaled_dot_product_attention
        fused = getattr(fused, "fused", fused)  # past the server's prefill routing
        return fused(queries, keys, values, scale=scale, mask=self.mask(room, queries.dtype))


def _supported(mx: Any, queries: Any, keys: Any, values: Any) -> bool:
    """Whether the fused call takes a chunk of this shape over a room of this size:
    tried once on zeros, which also builds its graph, before any cache depends on it."""
    _, heads, length, width = queries.shape
    kv_heads, room = keys.shape[1], keys.shape[2]
    key = (length, room, heads, kv_heads, width, str(queries.dtype))
    if key not in _tried:
        dtype = queries.dtype
        fused = mx.fast.scaled_dot_product_attention
        fused = getattr(fused, "fused", fused)
        try:
            zeros = mx.zeros((1, kv_heads, room, width), dtype=dtype)
            trial = RoomAttention(mx, prefix=0, length=length)
            mx.eval(fused(mx.zeros((1, heads, length, width), dtype=dtype), zeros,
                          mx.zeros((1, kv_heads, room, values.shape[3]), dtype=dtype),
                          scale=1.0, mask=trial.mask(room, dtype)))
            _tried[key] = True
        except Exception as exc:
            log.warning("a %d-token chunk's attention over a %d-token room failed as one "
                        "fused call (%s: %s); such chunks take the grouped products",
                        length, room, type(exc).__name__, exc)
            _tried[key] = False
    return _tried[key]
