"""How many waiting prompts join mlx-lm's prefill, and what the coming step prefills.

Reads (and sets ``prefill_batch_size`` of) a ``BatchGenerator`` between its
steps, through its private attributes ``_currently_processing``,
``_unprocessed_sequences``, ``_prompt_batch``, ``_generation_batch``,
``prefill_step_size`` and ``completion_batch_size``; ``runtime.mlx_lm_batches``'
``check_internals`` checks them against the installed mlx-lm.

* ``size_prefill_group``: how many waiting prompts join the prefill in the
  coming step, by their tokens and by the memory their attention takes
  (``runtime.engine.core``).
* ``coming_prefill``: what the coming step decodes and prefills, for the chunk
  size set between steps (``runtime.engine.pacing``).
* ``joiners``, ``coming_split``: the waiting sequences the coming step takes in,
  and whether it moves a prompt into decoding (``runtime.mixed_step``).
* ``tokens_to_come``: a reader of how many prompt tokens the prompt batch has
  still to prefill (``runtime.mlx_lm_batches``' room reservation).
* ``lone_prompt``: where the coming step prefills one prompt, its keys before the
  step and what is left of its segment (``runtime.engine.pacing``'s grid).

Receives and emits nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

# No MLX at import: the settings import runtime.mixed_step, which imports this, and
# a server loads its settings before MLX (OpenBLAS must come first: runtime.cpu_blas).
if TYPE_CHECKING:
    from mlx_lm.generate import BatchGenerator


# mlx-lm's ``BatchGenerator._next`` moves ``prefill_batch_size - len(_prompt_batch)``
# sequences from ``_unprocessed_sequences`` (entries ``(uid, segments, max_tokens,
# caches, ...)``) into the prompt batch each step, *before* it splits off the members
# whose prompt is
# done (``_currently_processing`` entries ``[segments, done, total]``; a member is
# done when one segment of one token is left, which ``generate`` takes). So a
# group of short prompts blocks the next group for a step after its prefill, and
# short prompts are prefilled eight at a time however few tokens that is. Before
# each step, ``size_prefill_group`` sets ``prefill_batch_size`` so that the step
# takes exactly the sequences we want: the done members leave room, and beyond
# ``base`` prefilling prompts more join while the tokens prefilled in the step stay
# within a budget.


def _first_chunk(segments: Sequence[Sequence[int]], step_size: int) -> int:
    """Prompt tokens a sequence's next prefill step processes (mlx-lm's rule)."""
    return min(len(segments[0]), step_size) if segments else 0


def _prefill_steps(segments: Sequence[Sequence[int]], step_size: int) -> int:
    """The prefill steps a sequence's segments take before its last token (mlx-lm
    stops at every segment end and gives the last token a segment of its own)."""
    return sum(-(-len(s) // step_size) for s in segments[:-1])


def _is_done(member: Sequence[Any]) -> bool:
    segments = member[0]
    return len(segments) == 1 and len(segments[0]) == 1


def _cached(sequence: Sequence[Any]) -> int:
    """A waiting sequence's cached prefix: the keys its caches hold before its prefill."""
    caches = sequence[3]
    return int(getattr(caches[0], "offset", 0) or 0) if caches else 0


def _depth(sequence: Sequence[Any]) -> int:
    """A waiting sequence's keys once prefilled: its cached prefix and its prompt."""
    return _cached(sequence) + sum(len(s) for s in sequence[1])


def group_scores(rows: int, queries: int, keys: int) -> int:
    """One attention head's scores in a prompt group's deepest prefill step: every row
    (padded to the longest chunk and to the deepest row) with ``queries`` queries
    against ``keys`` keys. Where the attention is not fused (MLX's fallback under
    mlx-lm's array mask, which a group of more than one prompt gets), they are in
    memory at once, several times over."""
    return rows * queries * keys


def _fits(rows: int, queries: int, keys: int, score_budget: int | None) -> bool:
    """Whether a group of ``rows`` prompts keeps within the budget; a lone prompt always
    does (its attention runs under the causal mask, fused or in bounded blocks)."""
    return score_budget is None or rows <= 1 or group_scores(rows, queries, keys) <= score_budget


def size_prefill_group(
    generator: BatchGenerator,
    *,
    base: int,
    token_budget: int | None,
    score_budget: int | None = None,
    full_chunk: int | None = None,
    alone_from: int | None = None,
) -> int:
    """Before ``generator.next()``: set its ``prefill_batch_size`` so that the step
    moves into the prompt batch the waiting sequences (in their order) that fit:
    up to ``base`` prompts prefilling at once as mlx-lm allows, not counting members
    whose prompt is done (they leave the prompt batch in this step), and more while
    the step's prompt tokens stay within ``token_budget``; never more than the
    decode batch has room for; a long prompt does not join members that finish
    their prefill in no more steps than it needs itself (it would be padded to
    their depth). ``token_budget`` None: mlx-lm's groups of ``base`` exactly, with
    neither rule. And never a group whose deepest step's attention scores
    (``group_scores``, per head: its longest prompt to prefill, up to a chunk of
    ``full_chunk`` queries, against its deepest row's keys; a paced chunk is smaller,
    but the group may outlive the pacing) pass ``score_budget``: a wave of long
    prompts is prefilled a few at a time rather than run the device out of memory.
    And prompts with more than ``alone_from`` tokens to prefill (None: no such rule)
    are prefilled one at a time, never two in one prompt batch (shorter ones join as
    above): where a lone prompt's chunks attend under the causal mask and a group's
    under mlx-lm's array mask (CUDA), two 16k-token prompts took 1.4-2.7 s together
    on an H100 against 0.3 each alone, and a wave of eight took 6.6 s to its median
    first token.
    Returns how many join."""
    step_size = generator.prefill_step_size
    members = generator._currently_processing
    prefilling = [m for m in members if not _is_done(m)]
    free = generator.completion_batch_size - len(generator._generation_batch) - len(members)
    if token_budget is None:
        free = min(free, base - len(prefilling))
    room = (token_budget or 0) - sum(_first_chunk(m[0], step_size) for m in prefilling)
    # mlx-lm prefills a prompt batch in lockstep: the rows' ends aligned (a prompt
    # that joins members deep into their prompts is padded to their depth) and every
    # row's chunk padded to the step's longest. So a long prompt (a full chunk to go)
    # joins only members with more prefill steps left than it has itself; otherwise
    # it waits for them to finish, and starts a group of its own.
    members_left = max((_prefill_steps(m[0], step_size) for m in prefilling), default=0)
    chunk = full_chunk or step_size
    depth = max((m[2] for m in prefilling), default=0)
    queries = max((sum(len(s) for s in m[0]) for m in prefilling), default=0)

    def alone(tokens: int) -> bool:  # the last token is the first decode step's input
        return alone_from is not None and tokens - 1 > alone_from

    long_one = any(alone(m[2]) for m in prefilling)
    joining = 0
    for sequence in generator._unprocessed_sequences:
        if joining >= free:
            break
        long = alone(sum(len(s) for s in sequence[1]))
        if long and long_one:
            break
        depth = max(depth, _depth(sequence))
        queries = max(queries, sum(len(s) for s in sequence[1]))
        if not _fits(len(prefilling) + joining + 1, min(queries, chunk), depth, score_budget):
            break
        if token_budget is not None:
            tokens = _first_chunk(sequence[1], step_size)
            if tokens >= step_size and 0 < members_left <= _prefill_steps(sequence[1], step_size):
                break
            if len(prefilling) + joining >= base and tokens > room:
                break
            room -= tokens
        joining += 1
        long_one = long_one or long
    generator.prefill_batch_size = len(generator._prompt_batch) + joining
    return joining


class ComingPrefill(NamedTuple):
    """What the coming ``generator.next()`` will do (``coming_prefill``)."""

    decoding: int  # sequences it decodes
    prompts: int  # prompts it prefills
    tokens: int  # their prefill tokens, padded to the longest chunk as mlx-lm pads them
    short: int  # the longest next segment of a prompt with at most ``short`` tokens in all
    depth: int = 0  # the keys the prompt batch holds (its longest row's, padding included)


def joiners(generator: BatchGenerator) -> list:
    """The waiting sequences the coming ``generator.next()`` moves into its prompt batch
    (none where its decoding rows fill it: mlx-lm prefills nothing in such a step)."""
    decoding = len(generator._generation_batch)
    if decoding >= generator.completion_batch_size:
        return []
    joining = min(
        generator.prefill_batch_size - len(generator._prompt_batch),
        generator.completion_batch_size - decoding,
        len(generator._unprocessed_sequences),
    )
    return list(generator._unprocessed_sequences)[: max(0, joining)]


def coming_split(generator: BatchGenerator) -> bool:
    """Whether the coming ``generator.next()`` moves a prompt into decoding: a member of
    its prompt batch, or a sequence that joins it in that step, with only its last
    token left."""
    if len(generator._generation_batch) >= generator.completion_batch_size:
        return False
    return any(map(_is_done, generator._currently_processing)) or any(
        _is_done((sequence[1],)) for sequence in joiners(generator))


def coming_prefill(generator: BatchGenerator, short: int = 0) -> ComingPrefill:
    """What the coming ``generator.next()`` will do, with the generator's sizes as set
    (``ComingPrefill``; ``short``: the most tokens to prefill in all that make a prompt
    short, 0 if none is)."""
    decoding = len(generator._generation_batch)
    if decoding >= generator.completion_batch_size:
        return ComingPrefill(decoding, 0, 0, 0)  # mlx-lm prefills nothing in such a step
    step_size = generator.prefill_step_size
    # (segments left, the prompt's tokens to prefill in all: ``[segments, done, total]``)
    prompts = [(m[0], m[2]) for m in generator._currently_processing if not _is_done(m)]
    for sequence in joiners(generator):
        prompts.append((sequence[1], sum(len(s) for s in sequence[1])))
    chunks, longest_short = [], 0
    for segs, total in prompts:
        chunk = _first_chunk(segs, step_size)
        if not chunk:
            continue
        chunks.append(chunk)
        # A short prompt (its last token is the generator's, not a prefill's).
        if total - 1 <= short:
            longest_short = max(longest_short, len(segs[0]))
    layers = generator._prompt_batch.prompt_cache
    depth = int(getattr(layers[0], "_idx", 0) or 0) if layers else 0
    return ComingPrefill(decoding, len(chunks), len(chunks) * max(chunks, default=0),
                         longest_short, depth)


def tokens_to_come(generator: BatchGenerator) -> Callable[[], int]:
    """A reader of the most prompt tokens a prompt batch member of ``generator`` has
    still to prefill (its last token, the first decode step's input, not counted)."""
    lasting = weakref.ref(generator)  # no cycle: a replaced generator's caches go at once

    def read() -> int:
        owner = lasting()
        if owner is None:
            return 0
        return max(
            (sum(len(s) for s in member[0]) - 1 for member in owner._currently_processing),
            default=0,
        )

    return read


class LonePrompt(NamedTuple):
    """The one prompt the coming ``generator.next()`` prefills (``lone_prompt``)."""

    prefix: int  # the keys its cache holds before the step's chunk
    segment: int  # the tokens left of its current segment (a chunk stops at its end)


def lone_prompt(generator: BatchGenerator) -> LonePrompt | None:
    """The prompt the coming ``generator.next()`` prefills, with the generator's sizes as
    set, where it prefills exactly one; else None. A member's keys are the prompt batch's
    less its row's left padding (members whose prompt is done leave in that step, and
    the padding they shared goes with them); a joiner's, its cached prefix."""
    if len(generator._generation_batch) >= generator.completion_batch_size:
        return None
    members = generator._currently_processing
    prefilling = [i for i, m in enumerate(members) if not _is_done(m)]
    joining = joiners(generator)
    if len(prefilling) + len(joining) != 1:
        return None
    if joining:
        segments, prefix = joining[0][1], _cached(joining[0])
    else:
        row = prefilling[0]
        segments = members[row][0]
        layer = generator._prompt_batch.prompt_cache[0]
        prefix = int(getattr(layer, "_idx", 0) or 0)
        if len(members) > 1 and getattr(layer, "left_padding", None) is not None:
            # Read whole: indexing the array would queue an op behind the step in flight
            # and wait for the device.
            prefix -= int(layer.left_padding.tolist()[row])
    return LonePrompt(prefix, len(segments[0]) if segments else 0)
