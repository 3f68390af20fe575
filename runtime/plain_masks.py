"""Attention masks that mlx-lm builds as arrays where one row needs none.

mlx-lm's ``BatchKVCache`` gives every forward pass a boolean mask array, one
row per sequence, so that each row can skip its left padding. A batch of one
row without padding needs no array: its prefill chunk's mask is exactly
``"causal"`` (every key up to the query's own position, aligned to the last
key, as MLX defines it), and its decode step's is no mask at all. So does a
prompt batch of several rows none of which is left-padded: sessions that start
together from one cached system prompt, or fresh prompts (mlx-lm pads a prompt
batch's tokens on the right; a padded token's key lies after every real query
of its row, which the causal mask hides, and ``finalize`` then moves it left).

On CUDA the array costs: MLX hands cuDNN a prefill chunk's mask as a bias it
reads in full in every layer (``"causal"`` lets it skip the masked blocks: a
2,048-query chunk's attention after 4k-30k tokens took a quarter of the time on
an H200, ``bench/chunk_masks.py``), and MLX's CUDA attention takes no boolean
mask, so every layer of a decode step first turns the array into an additive
one, which the attention then reads (with none, only the keys and values).

Owns ``plain_masks``, which ``runtime.mlx_lm_batches``' prompt and generation
batches put around their model calls. Receives and emits nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mlx_lm.models.cache import BatchKVCache


@contextlib.contextmanager
def plain_masks(caches: list, rows: int, *, several: bool = False) -> Iterator[None]:
    """Around a batch's model call over ``rows`` rows: where that is one row with no
    left padding (or, with ``several``, any number of rows none of which is
    left-padded), its ``BatchKVCache`` layers give ``"causal"`` for a chunk of several
    tokens and None for one token, instead of mlx-lm's array. Any other batch, and a
    mask asked for as an array or with a window, is left as it was.

    ``several`` reads the rows' paddings, which waits for the device where they are
    still being computed (a prompt batch's chunk whose ``finalize`` is in flight): set
    it only where the batch's work so far has been waited for (a prompt batch's
    ``prompt`` with nothing decoding, which mlx-lm evaluates to the end)."""
    if rows != 1 and not several:
        yield
        return
    plain = [c for c in caches if type(c) is BatchKVCache]
    padding = plain[0].left_padding if plain else None
    if padding is None or padding.size != rows or any(padding.tolist()):
        yield
        return
    for c in plain:
        c.make_mask = _plain_mask_maker(c)
    try:
        yield
    finally:
        for c in plain:
            c.__dict__.pop("make_mask", None)


def _plain_mask_maker(cache):
    """``cache``'s ``make_mask`` for one unpadded row (see ``plain_masks``)."""
    made_by_class = cache.make_mask

    def make_mask(n, return_array=False, **kwargs):
        if return_array or kwargs.get("window_size") is not None:
            return made_by_class(n, return_array=return_array, **kwargs)
        return "causal" if n > 1 else None

    return make_mask
