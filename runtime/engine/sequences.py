"""One sequence in the engine core's batch generator: its record, its tokens, its prompt.

``SequenceRecord`` is what an ``EngineCore`` keeps of each sequence it
inserted (request id, the generator's uid, what logprobs it wants, the types
of the prompt segments still to be saved, its prompt-cache partition).
``token_event`` receives a generator's response for one sequence and emits
its ``TokenEvent`` (``token_logprobs`` picks the sampled token's logprob and
the top ones from the response's MLX array). At admission,
``uncached_segments`` gives the prompt segments the prompt cache did not
cover, and ``back_off_one_token`` gives back one token of an exact hit so
that the model has a token to feed. ``plain_kv_caches`` says whether a model's
cache can be cut back at any length, and ``without_thinking_tail`` drops the
save point such a cache does not need. Everything here runs on the engine thread.
"""

from __future__ import annotations

from typing import Any

import attrs

from runtime.messages import FinishReason, TokenEvent

# mlx-lm's finish reasons ("stop", "length") as ours, without an enum lookup per token.
_FINISH_REASONS = {reason.value: reason for reason in FinishReason}


@attrs.define
class SequenceRecord:
    """What the engine core keeps of one sequence in its batch generator."""

    request_id: int
    uid: int  # the batch generator's id
    logprobs: bool
    top_logprobs: int
    segment_types: list[str]  # reversed: pop() gives the next segment's type
    save_final: bool = True  # its cache goes to the prompt cache when it finishes
    cache_key: Any = None  # its prompt-cache partition (the model's key, with a scope)
    # Its prompt's progress: (done, total) tokens of the part its cache did not hold.
    prompt_progress: tuple[int, int] = (0, 0)
    # Read for every token: computed once.
    wants_logprobs: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.wants_logprobs = self.logprobs or self.top_logprobs > 0


def token_event(seq: SequenceRecord, response: Any) -> TokenEvent:
    """The one place a generator's response becomes a ``TokenEvent``."""
    token = int(response.token)
    logprob, top = None, ()
    if seq.wants_logprobs:
        logprob, top = token_logprobs(response.logprobs, token, seq.top_logprobs)
    reason = response.finish_reason  # mlx-lm: "stop", "length" or None
    return TokenEvent(
        request_id=seq.request_id,
        token=token,
        finish_reason=None if reason is None else _FINISH_REASONS.get(reason)
        or FinishReason(reason),
        logprob=logprob,
        top_logprobs=top,
    )


def token_logprobs(lp: Any, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The sampled token's logprob and the top ``n`` (token, logprob), best first."""
    import mlx.core as mx

    lp = lp.reshape(-1)
    chosen = lp[token]
    if n <= 0:
        return chosen.item(), ()
    n = min(n, lp.shape[-1])
    idx = mx.argpartition(-lp, kth=n - 1)[:n]
    vals = lp[idx]
    order = mx.argsort(-vals)
    idx, vals = idx[order], vals[order]
    mx.eval(chosen, idx, vals)
    return chosen.item(), tuple(zip(idx.tolist(), vals.tolist(), strict=True))


def uncached_segments(segments, segment_types, cached: int) -> tuple[list[list[int]], list[str]]:
    """A prompt's segments and their types past its first ``cached`` tokens."""
    segments = [list(s) for s in segments]
    types = list(segment_types)
    skip = cached
    while skip > 0 and segments:
        if skip >= len(segments[0]):
            skip -= len(segments.pop(0))
            types.pop(0)
        else:
            segments[0] = segments[0][skip:]
            skip = 0
    return segments, types


def plain_kv_caches(model: Any) -> bool:
    """Whether every layer of ``model``'s prompt cache is a plain ``KVCache`` (which
    can be trimmed to any shorter prefix); False for a model that cannot say."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    try:
        caches = make_prompt_cache(model)
    except Exception:
        return False
    return bool(caches) and all(type(c) is KVCache for c in caches)


def without_thinking_tail(segments, segment_types) -> tuple[tuple, tuple]:
    """The segments with a thinking tail (a last "assistant" segment after others:
    ``runtime.prompts.plan_segments``) joined to the segment before it.

    The tail's save point (the prompt before an empty or opening think block)
    is what the next turn reuses, since templates drop past turns' think blocks.
    With plain ``KVCache`` layers the finished sequence's entry serves that
    prefix just as well (mlx-lm's fetch trims a longer entry to the common
    prefix, and its insert drops the shorter entry then anyway), while the save
    point costs the prompt one more prefill step: the generator stops at every
    segment end."""
    if len(segment_types) < 2 or segment_types[-1] != "assistant":
        return segments, segment_types
    joined = tuple(segments[-2]) + tuple(segments[-1])
    return (*segments[:-2], joined), tuple(segment_types[:-1])


def back_off_one_token(cache: list, prompt: list[int]) -> tuple[list | None, list[int]]:
    """An exact prompt-cache hit leaves nothing to feed the model: give back its last token."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if len(prompt) > 1 and can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, 1)
        return cache, prompt[-1:]
    return None, prompt
