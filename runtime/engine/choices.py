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

import copy

import attrs

from runtime.messages import Submit


def choice_submit(first: Submit, index: int, request_id: int) -> Submit:
    """Choice ``index``: the first choice's Submit under its own id (and seed)."""
    sampling = first.sampling
    if sampling.seed is not None:
        sampling = attrs.evolve(sampling, seed=(sampling.seed + index) % 2**63)
    return attrs.evolve(first, request_id=request_id, choice_ids=(), sampling=sampling)


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

    def wait_for(self, first: Submit) -> None:
        self._by_first[first.request_id] = further_choices(first)

    def request_ids(self) -> list[int]:
        return [c.request_id for choices in self._by_first.values() for c in choices]

    def take(self, first_id: int) -> list[Submit]:
        """The choices waiting for ``first_id`` (they start now, or leave with it)."""
        return self._by_first.pop(first_id, [])

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


def without_choice(submit: Submit, request_id: int) -> Submit | None:
    """``submit`` without choice ``request_id`` (an abort while it is held), or None
    if that is not one of its further choices."""
    if request_id not in submit.choice_ids:
        return None
    return attrs.evolve(submit, choice_ids=tuple(c for c in submit.choice_ids if c != request_id))
