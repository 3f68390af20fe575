"""KV reservations: the share of the KV budget each sequence in the engine holds.

``KvReservations`` (sans-IO, owned by ``actors.scheduler.SchedulerCore``) receives
the requests the Scheduler starts, each engine step's tokens and terminal events,
and the budget; it answers what a waiting request needs to start (``needed``),
what the sequences hold together (``total``), which sequences to preempt when the
budget runs short (``preempt``), and the request that resumes a preempted one
(``resumed``).

A request reserves its prompt plus ``max_tokens``, unless it can be preempted:
then its prompt plus ``reply_tokens`` (at most ``max_tokens``), grown by
``reply_tokens`` each time its reply reaches the end of what it holds. Coding
agents ask for 32,000-128,000 tokens a reply and use a few hundred to a few
thousand, so reserving ``max_tokens`` whole keeps most of the budget idle and
their sessions waiting. When the sequences' growth takes the total over the
budget, the most recently started preemptible sequences leave the engine (an
``Abort`` with ``AbortReason.PREEMPTED``), and each resumes at the head of the
queue as a request whose prompt is its prompt and the tokens it has generated,
with the tokens left of its ``max_tokens`` (vLLM's preemption, SGLang's
retraction). The engine leaves a preempted sequence's KV, its reply's included, in
the prompt cache, so the resumption computes at most what was evicted meanwhile.

Preemptible: one choice, no constraint, no images, no seed (a resumed sequence
draws from a new random state), and a known KV size per token. The others
reserve ``max_tokens`` whole, as do all with ``reply_tokens`` 0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import attrs

from runtime.messages import Submit, TokenEvent

log = logging.getLogger(__name__)


@attrs.define
class _Held:
    """One sequence's reservation (each choice of a request has its own)."""

    submit: Submit
    nbytes: int  # what it holds of the budget now
    room: int  # tokens it holds: prompt and reply
    generated: list[int] | None  # its tokens so far; None: not preemptible
    preempting: bool = False  # asked to leave; it holds its bytes until it has left


def preemptible(submit: Submit) -> bool:
    """Whether ``submit`` can leave the engine and resume from its tokens so far."""
    return (
        submit.kv_bytes_per_token > 0
        and not submit.choice_ids
        and submit.constraint is None
        and submit.vision is None
        and submit.sampling.seed is None
    )


class KvReservations:
    """The sequences' reservations (see the module's docstring)."""

    def __init__(self, reply_tokens: int = 0):
        if reply_tokens < 0:
            raise ValueError("reply_tokens must be >= 0")
        self.reply_tokens = reply_tokens
        self._held: dict[int, _Held] = {}  # by request id, in the order they started
        self.preemptions = 0

    @property
    def total(self) -> int:
        return sum(held.nbytes for held in self._held.values())

    def _clipped(self, submit: Submit) -> bool:
        return self.reply_tokens > 0 and preemptible(submit)

    def needed(self, submit: Submit) -> int:
        """Bytes ``submit`` reserves as it starts (every choice)."""
        if not self._clipped(submit):
            return submit.kv_bytes
        reply = min(submit.max_tokens, self.reply_tokens)
        return submit.kv_bytes_per_token * (len(submit.prompt) + reply)

    def start(self, submit: Submit) -> None:
        if not self._clipped(submit):
            share = submit.kv_bytes // len(submit.request_ids)
            for request_id in submit.request_ids:
                self._held[request_id] = _Held(submit, share, 0, None)
            return
        nbytes = self.needed(submit)
        room = nbytes // submit.kv_bytes_per_token
        self._held[submit.request_id] = _Held(submit, nbytes, room, [])

    def release(self, request_id: int) -> None:
        self._held.pop(request_id, None)

    def is_preempting(self, request_id: int) -> bool:
        held = self._held.get(request_id)
        return held is not None and held.preempting

    def count(self, tokens: Iterable[TokenEvent]) -> None:
        """A step's tokens: each preemptible sequence's reply, its room grown as it fills."""
        for event in tokens:
            held = self._held.get(event.request_id)
            if held is None or held.generated is None:
                continue
            held.generated.append(event.token)
            submit = held.submit
            if len(submit.prompt) + len(held.generated) >= held.room:
                held.room = min(held.room + self.reply_tokens, len(submit.prompt) + submit.max_tokens)
                held.nbytes = held.room * submit.kv_bytes_per_token

    def preempt(self, budget: int | None) -> list[int]:
        """The sequences to take out of the engine so that the rest fit ``budget``: the
        most recently started preemptible ones, never the last one left. They keep
        their bytes until they have left (``resumed``)."""
        excess = 0 if budget is None else self.total - budget
        if excess <= 0:
            return []
        staying = [i for i, held in self._held.items() if not held.preempting]
        chosen: list[int] = []
        for request_id in reversed(staying):
            if excess <= 0 or len(staying) - len(chosen) <= 1:
                break
            held = self._held[request_id]
            if held.generated is None:
                continue
            held.preempting = True
            excess -= held.nbytes
            chosen.append(request_id)
            log.info(
                "KV budget: preempting request %d after %d reply tokens; it resumes from them",
                request_id, len(held.generated),
            )
        self.preemptions += len(chosen)
        return chosen

    def resumed(self, request_id: int) -> Submit:
        """A preempted sequence has left the engine: the request that resumes it. Its
        reservation is released.

        It left before its last token (a finished sequence is not aborted), so at
        least one token is left for it to generate."""
        held = self._held.pop(request_id)
        generated = tuple(held.generated or ())
        submit = held.submit
        if generated:
            submit = attrs.evolve(
                submit,
                prompt=submit.prompt + generated,
                segments=(*submit.segments, generated),
                segment_types=(*submit.segment_types, "assistant"),
                max_tokens=submit.max_tokens - len(generated),
            )
        return attrs.evolve(submit, followed=False)
