"""PromptCacheActor: the prompt cache's policy and statistics.

The cache's data (mlx-lm's ``LRUPromptCache``: a token trie of KV caches with
three LRUs by segment type and count/byte limits) lives on the engine thread,
because every lookup copies or trims MLX arrays. This actor owns the rest:

* the statistics: it receives an ``EngineStats`` snapshot per engine step
  from the Scheduler and logs what changed, at most every 30 s.
  ``cache_figures`` renders a snapshot's cache part for ``/health``.
"""

from __future__ import annotations

import logging

import trio

from runtime.messages import EngineStats

log = logging.getLogger(__name__)


def cache_figures(s: EngineStats) -> dict[str, int]:
    return {
        "entries": s.prompt_cache_entries,
        "bytes": s.prompt_cache_bytes,
        "hits": s.prompt_cache_hits,
        "cached_tokens": s.prompt_cache_cached_tokens,
    }


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
