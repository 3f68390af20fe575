"""Grammar matchers plugged into the engine: the batched path and the serial path.

Engine thread only. ``GrammarBackend`` is ``runtime.batch_sampling``'s
``ConstraintBackend`` over llguidance (``runtime.grammar.matcher``): it makes
one ``RowMatcher`` per inserted sequence (``new_constraint(spec)``: the
sampler's ``RowConstraint``, fed every token the row samples) and fills the
bitmasks of all constrained rows of a step in one call. ``constraint_processor``
is the same constraint as an mlx-lm logits processor, for the serial path
(``stream_generate``: a quantized KV cache or a model whose cache cannot be
batched), one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.grammar.matcher import GrammarTokenizer, RowMatcher, fill_bitmasks


class GrammarBackend:
    """The batch sampler's ``ConstraintBackend``: masks ``vocab_size`` tokens wide."""

    def __init__(self, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size

    def new_constraint(self, spec: Any) -> RowMatcher:
        """One sequence's matcher for its ``ConstraintSpec`` (``ValueError``: rejected)."""
        return spec.new_matcher(self.tokenizer)

    def fill_bitmasks(self, rows: Sequence[tuple[RowMatcher, int]], bitmask: np.ndarray) -> None:
        fill_bitmasks([matcher for matcher, _ in rows], bitmask, [row for _, row in rows])

    def preferred_tokens(self, rows: Sequence[tuple[RowMatcher, int]]) -> list[tuple[int, int]]:
        """(row, token): allowed only if the row's unmasked argmax (``preferred_opening``)."""
        return [(row, m.preferred_opening) for m, row in rows if m.preferred_opening is not None]


def constraint_processor(matcher: RowMatcher, tokenizer: GrammarTokenizer):
    """An mlx-lm logits processor ``(tokens, logits) -> logits`` enforcing ``matcher``.

    mlx-lm's ``generate_step`` calls it once per sampled token with every
    token so far: the first call sees the prompt, each later one the prompt
    and the samples, the newest last, which is fed to the matcher. Tokens
    the matcher does not allow get ``-inf``, as do logits columns past the
    tokenizer's vocabulary; a thinking block may open first only where the
    model prefers it (``RowMatcher.preferred_opening``). One synchronisation
    per token (the serial path has no overlap to lose).
    """
    import mlx.core as mx

    bitmask = tokenizer.allocate(1)
    first = True

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal first
        if first:
            first = False
        else:
            matcher.consume(int(tokens[-1].item()))
        fill_bitmasks([matcher], bitmask)
        width = logits.shape[-1]
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, : min(width, tokenizer.vocab_size)]
        if allowed.shape[1] < width:
            allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
        opening = matcher.preferred_opening
        if opening is not None and int(mx.argmax(logits[-1]).item()) == opening:
            allowed[:, opening] = 1
        return mx.where(mx.array(allowed.astype(bool)), logits, -mx.inf)

    return process
