"""Several choices of one request (n > 1): their prompt is computed once.

A ``Submit`` with ``choice_ids`` asks for n sequences of the same prompt. The
engine core inserts the first choice alone; ``PendingChoices`` holds the
others until the generator reports the first one's prompt processed up to its
last token. Then each starts from a copy of that KV cache and computes only
the last token itself (``starts``), so the prompt's prefill runs once, not n
times. A generator that reports no such point (``SerialGenerator`` takes the
prompt whole), and a prompt the prompt cache already covers, start them the
ordinary way.

Each choice is a sequence of its own in the batch, under its own request id,
sampled on its own: with a seed, choice i uses seed + i (as vLLM does), so
seeded choices differ from one another and are reproducible.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable

import attrs

from runtime.messages import Submit


def choice_submit(first: Submit, index: int, request_id: int) -> Submit:
    """Choice ``index``: the first choice's Submit under its own id (and seed)."""
    sampling = first.sampling
    if sampling.seed is not None:
        sampling = attrs.evolve(sampling, seed=(sampling.seed + index) % 2**63)
    return attrs.evolve(first, request_id=request_id, choice_ids=(), sampling=sampling)


def prompt_but_last_done(response) -> bool:
    """A generator's prompt response saying all the prompt but its last token is processed
    (mlx-lm's BatchGenerator always gives that last token a segment of its own)."""
    done, total = response.progress
    return response.end_of_segment and not response.end_of_prompt and done == total - 1


def further_choices(first: Submit) -> list[Submit]:
    return [choice_submit(first, i, r) for i, r in enumerate(first.choice_ids, 1)]


def starts(cache: list | None, n: int, *, own: bool = False) -> list[list | None]:
    """``n`` caches to start choices from: copies of ``cache`` (``own``: nobody else
    holds it, so the last choice takes it itself)."""
    if cache is None:
        return [None] * n
    return [cache if own and i == n - 1 else copy.deepcopy(cache) for i in range(n)]


class PendingChoices:
    """Choices waiting for their first choice's prompt, by the first choice's request id."""

    def __init__(self) -> None:
        self._by_first: dict[int, list[Submit]] = {}

    def __contains__(self, first_id: int) -> bool:
        return first_id in self._by_first

    def __bool__(self) -> bool:
        return bool(self._by_first)

    def wait_for(self, first: Submit) -> None:
        self._by_first[first.request_id] = further_choices(first)

    def request_ids(self) -> list[int]:
        return [c.request_id for choices in self._by_first.values() for c in choices]

    def take(self, first_id: int) -> list[Submit]:
        """The choices waiting for ``first_id`` (they start now, or leave with it)."""
        return self._by_first.pop(first_id, [])

    def start(
        self, first_id: int, cache: list | None, submit: Callable[..., None], *, own: bool = False
    ) -> None:
        """Start the choices waiting for ``first_id``'s prompt: ``submit(choice, start=...,
        clone=True)`` from copies of ``cache`` (its prompt but the last token), or,
        without one (``None``), the ordinary way."""
        choices = self.take(first_id)
        for choice, start in zip(choices, starts(cache, len(choices), own=own), strict=True):
            submit(choice, start=start, clone=True)

    def drop(self, request_id: int) -> bool:
        """Forget one waiting choice (its abort); whether it was waiting."""
        for choices in self._by_first.values():
            for choice in choices:
                if choice.request_id == request_id:
                    choices.remove(choice)
                    return True
        return False

    def clear(self) -> None:
        self._by_first.clear()


def abort_waiting(
    held: collections.deque[tuple[float, Submit]], pending: PendingChoices, request_id: int
) -> tuple[int, ...]:
    """An abort of a request the admission window ``held``, or of a choice ``pending``:
    the request ids it ends (none if it is neither). A held first choice takes its
    further choices with it (they are aborted together)."""
    for i, (held_at, submit) in enumerate(held):
        if submit.request_id == request_id:
            del held[i]
            return submit.request_ids
        if request_id in submit.choice_ids:
            others = tuple(c for c in submit.choice_ids if c != request_id)
            held[i] = (held_at, attrs.evolve(submit, choice_ids=others))
            return (request_id,)
    return (request_id,) if pending.drop(request_id) else ()
