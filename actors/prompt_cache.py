"""PromptCacheActor: the prompt cache's policy and statistics.

The cache's data (mlx-lm's ``LRUPromptCache``: a token trie of KV caches with
three LRUs by segment type and count/byte limits) lives on the engine thread,
because every lookup copies or trims MLX arrays. This actor owns the rest:

* the segmentation policy, ``plan_segments``: where in a chat prompt the
  engine should keep a copy of the KV cache (end of the system prompt, end of
  the conversation before a thinking tail), as mlx_lm.server does, so a new
  conversation with the same system prompt, or the next turn of this one,
  starts from a cached prefix;
* the statistics: it receives an ``EngineStats`` snapshot per engine step
  from the Scheduler and keeps the latest (entries, bytes, hits, cached
  tokens) for ``/health`` and ``/metrics`` and for periodic logging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import attrs
import trio

from runtime.messages import EngineStats

log = logging.getLogger(__name__)

THINKING_TAIL_TOKENS = 11


@attrs.frozen(kw_only=True)
class SegmentPlan:
    segments: tuple[tuple[int, ...], ...]
    segment_types: tuple[str, ...]


def plan_segments(
    prompt: Sequence[int],
    *,
    last_role: str,
    system_prefix: Sequence[int] | None,
    think_start_at: Callable[[Sequence[int], int], int] | None,
) -> SegmentPlan:
    """Split a chat prompt into cacheable segments.

    ``system_prefix`` is the template rendered with only the system messages
    (and an empty user turn) or None; ``think_start_at(prompt, start)`` finds
    the last think-start token at or after ``start`` (-1 if none). Segment
    types order the cache's eviction: "assistant" first, then "user", then
    "system".
    """
    prompt = tuple(prompt)
    whole = SegmentPlan(segments=(prompt,), segment_types=("assistant",))
    if last_role != "user" or not prompt:
        return whole

    segments: list[tuple[int, ...]] = []
    types: list[str] = []
    sys_end = 0
    if system_prefix:
        for i, (a, b) in enumerate(zip(system_prefix, prompt, strict=False)):
            if a != b:
                sys_end = i
                break
        if 0 < sys_end < len(prompt):
            segments.append(prompt[:sys_end])
            types.append("system")

    tail_start = len(prompt)
    if think_start_at is not None:
        found = think_start_at(prompt, tail_start - THINKING_TAIL_TOKENS)
        if found >= 0:
            tail_start = max(found, sys_end)  # never overlap the system segment

    if sys_end < tail_start:
        segments.append(prompt[sys_end:tail_start])
        types.append("user")
    if tail_start < len(prompt):
        segments.append(prompt[tail_start:])
        types.append("assistant")
    if not segments:
        return whole
    return SegmentPlan(segments=tuple(segments), segment_types=tuple(types))


class PromptCacheStats:
    """Sans-IO: the latest engine snapshot, and what changed since the last log line."""

    def __init__(self) -> None:
        self.latest = EngineStats()
        self._logged = EngineStats()

    def update(self, stats: EngineStats) -> None:
        self.latest = stats

    def log_line(self) -> str | None:
        s = self.latest
        if (s.prompt_cache_entries, s.prompt_cache_bytes, s.prompt_cache_hits) == (
            self._logged.prompt_cache_entries,
            self._logged.prompt_cache_bytes,
            self._logged.prompt_cache_hits,
        ):
            return None
        self._logged = s
        return (
            f"prompt cache: {s.prompt_cache_entries} entries, "
            f"{s.prompt_cache_bytes / 1e6:.1f} MB, {s.prompt_cache_hits} hits, "
            f"{s.prompt_cache_cached_tokens} tokens reused"
        )

    def as_dict(self) -> dict[str, int]:
        s = self.latest
        return {
            "entries": s.prompt_cache_entries,
            "bytes": s.prompt_cache_bytes,
            "hits": s.prompt_cache_hits,
            "cached_tokens": s.prompt_cache_cached_tokens,
        }


class PromptCacheActor:
    def __init__(self, stats: PromptCacheStats | None = None, *, log_every: float = 30.0):
        self.stats = stats or PromptCacheStats()
        self._log_every = log_every

    async def run(
        self,
        reports: trio.MemoryReceiveChannel[EngineStats],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        next_log = trio.current_time() + self._log_every
        async with reports:
            async for stats in reports:
                self.stats.update(stats)
                if trio.current_time() >= next_log:
                    next_log = trio.current_time() + self._log_every
                    line = self.stats.log_line()
                    if line:
                        log.info(line)
