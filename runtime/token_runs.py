"""Token sequences as compact runs, compared in C: what both prompt-cache tries walk.

Owns ``tokens_array`` and ``common_run``, used by the engine's radix trie
(``runtime.prompt_trie``) and by the prompt-cache policy's index
(``actors.prompt_cache_index``), and ``FIRST_SPAN_REACH``, which the engine's
fetch and the policy's prediction of it share. Receives token sequences; emits
nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

# A fetch that reuses at most this many tokens past its entry's first span, a stored
# system prompt, reuses the span alone (``runtime.fetched_kv.at_first_span``; the
# prompt-cache policy predicts the same).
FIRST_SPAN_REACH = 64


def tokens_array(tokens: Sequence[int]) -> array:
    """``tokens`` as a compact ``array('i')`` (itself if it is one)."""
    return tokens if isinstance(tokens, array) else array("i", tokens)


def common_run(label: array, tokens: array, start: int) -> int:
    """How many leading tokens of ``label`` equal ``tokens[start:]``'s."""
    segment = tokens[start : start + len(label)]
    if segment == label:
        return len(label)
    lo, hi = 0, min(len(segment), len(label))
    while lo < hi:  # the longest common prefix, by slice comparisons done in C
        mid = (lo + hi + 1) // 2
        if label[:mid] == segment[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
