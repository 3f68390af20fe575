"""Requests that share a prefix nobody has cached yet: its prefill runs once.

Coding agents' sessions share one long system prompt and often start
together. Inserted side by side, each would compute that prompt itself (as
mlx_lm.server and its MLX peers do). ``SharedPrefills`` is the engine core's
record of the sequences whose prompt is being prefilled and of the points
where the prompt cache will store a copy of their KV (the ends of their
segments: ``runtime.prompts.plan_segments``). A new request whose prompt
repeats one of them up to such a point, and which the prompt cache cannot
already serve that far, waits behind that sequence (its *leader*) instead of
joining the batch. When the leader's KV up to the point is stored, the
request is released and inserted the ordinary way: its lookup then finds the
stored prefix, and it prefills only the rest. If the leader leaves first
(aborted, failed, or its stores passed over), its followers are released
all the same and find what the cache holds.

Sans-IO and without MLX: the core calls ``track`` when it inserts a
sequence, ``progressed`` and ``stored`` as its prompt responses come,
``ended`` when it leaves, and ``wait_behind`` before it inserts a request;
the requests these return are the core's to insert. Receives ``Submit``s;
emits them back, and ``(request_id, done, total)`` progress for the waiting
ones, so their streams get keep-alives while they wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from runtime.messages import Submit


@attrs.define
class _Leader:
    prompt: tuple[int, ...]
    points: list[int]  # ascending token counts where a copy of its KV is still to be stored
    cached: int  # prompt tokens it started with (from the prompt cache)
    done: int  # prompt tokens in its KV so far
    scope: str = ""  # its prompt-cache scope: only requests of the same one wait behind it


@attrs.define
class _Follower:
    submit: Submit
    point: int  # the leader's store it waits for


def save_points(segments: Sequence[Sequence[int]], cached: int) -> list[int]:
    """Where a prompt of these segments gets a prompt-cache copy while it is prefilled:
    the end of every segment but the last, past the ``cached`` tokens it starts with."""
    points, end = [], 0
    for segment in segments[:-1]:
        end += len(segment)
        if end > cached:
            points.append(end)
    return points


class SharedPrefills:
    """The sequences being prefilled that others may wait behind, and who waits.

    ``min_tokens``: a request waits only when the leader's store gives it at
    least this many tokens more than the prompt cache gives it now (0: never
    waits)."""

    def __init__(self, min_tokens: int):
        self.min_tokens = min_tokens
        self._leaders: dict[int, _Leader] = {}
        self._followers: dict[int, list[_Follower]] = {}  # by leader request id

    def __bool__(self) -> bool:
        return bool(self._followers)

    def request_ids(self) -> list[int]:
        """The requests waiting behind a leader (with their further choices)."""
        return [i for fs in self._followers.values() for f in fs for i in f.submit.request_ids]

    def track(
        self, request_id: int, prompt: Sequence[int], points: list[int], cached: int,
        *, scope: str = "",
    ) -> None:
        """A sequence inserted with ``cached`` prompt tokens from the prompt cache and its
        stores still to come at ``points``, in the prompt cache's ``scope``."""
        if self.min_tokens > 0 and points:
            self._leaders[request_id] = _Leader(tuple(prompt), list(points), cached, cached, scope)

    def wait_behind(self, submit: Submit, cached_now: Callable[[Sequence[int]], int]) -> bool:
        """Park ``submit`` behind a leader whose coming store it repeats; whether it waits.

        ``cached_now(tokens)``: how many leading ``tokens`` the prompt cache can
        serve now (asked once, for the best candidate)."""
        if not self._leaders:
            return False
        prompt = submit.prompt
        best: tuple[int, int, int] | None = None  # (point, done, leader id)
        for leader_id, leader in self._leaders.items():
            if leader.scope != submit.cache_scope:
                continue  # its store is in another scope: of no use to this request
            for point in reversed(leader.points):
                # The last prompt token is always computed by the request itself.
                if point < len(prompt) and prompt[:point] == leader.prompt[:point]:
                    if best is None or (point, leader.done) > best[:2]:
                        best = (point, leader.done, leader_id)
                    break
        if best is None:
            return False
        point, _, leader_id = best
        if point - cached_now(prompt[:point]) < self.min_tokens:
            return False
        self._followers.setdefault(leader_id, []).append(_Follower(submit, point))
        return True

    def progressed(self, request_id: int, done: int) -> None:
        """The generator's progress of a sequence: ``done`` tokens past its cached ones."""
        leader = self._leaders.get(request_id)
        if leader is not None:
            leader.done = leader.cached + done

    def stored(self, request_id: int, tokens: int) -> list[Submit]:
        """The leader's KV up to ``tokens`` is in the prompt cache now: the requests that
        waited for that point (or an earlier one) go."""
        leader = self._leaders.get(request_id)
        if leader is None:
            return []
        leader.points = [p for p in leader.points if p > tokens]
        leader.done = max(leader.done, tokens)
        if not leader.points:
            del self._leaders[request_id]
            return self._release(request_id)
        waiting = self._followers.get(request_id, [])
        going = [f for f in waiting if f.point <= tokens]
        if going:
            self._followers[request_id] = [f for f in waiting if f.point > tokens]
        return [f.submit for f in going]

    def ended(self, request_id: int) -> list[Submit]:
        """The leader left the batch (finished, aborted, failed): its followers go."""
        self._leaders.pop(request_id, None)
        return self._release(request_id)

    def _release(self, leader_id: int) -> list[Submit]:
        return [f.submit for f in self._followers.pop(leader_id, [])]

    def drop(self, request_id: int) -> tuple[int, ...]:
        """An abort of a waiting request: the request ids it ends (none if it was not
        waiting). A first choice takes its further choices with it."""
        for leader_id, waiting in self._followers.items():
            for follower in waiting:
                submit = follower.submit
                if submit.request_id == request_id:
                    waiting.remove(follower)
                    if not waiting:
                        del self._followers[leader_id]
                    return submit.request_ids
                if request_id in submit.choice_ids:
                    others = tuple(c for c in submit.choice_ids if c != request_id)
                    follower.submit = attrs.evolve(submit, choice_ids=others)
                    return (request_id,)
        return ()

    def progress(self) -> list[tuple[int, int, int]]:
        """``(request_id, done, total)`` for each waiting request: its leader's progress
        up to the point it waits for."""
        out = []
        for leader_id, waiting in self._followers.items():
            leader = self._leaders.get(leader_id)
            done = leader.done if leader is not None else 0
            for f in waiting:
                out.append((f.submit.request_id, min(done, f.point), len(f.submit.prompt)))
        return out

    def clear(self) -> list[Submit]:
        """Forget every leader (the batch is gone); the requests that waited."""
        self._leaders.clear()
        waiting = [f.submit for fs in self._followers.values() for f in fs]
        self._followers.clear()
        return waiting
