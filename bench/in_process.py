"""Requests for an engine core driven in-process by a benchmark (no server).

``RandomPrompts`` submits prompts of random token ids to an ``EngineCore`` (as
``runtime.engine.loading.make_engine_core`` builds it) and hands out their request
ids; the benchmarks that time the core's steps share it.
"""

from __future__ import annotations

import random
from typing import Any


class RandomPrompts:
    """Greedy requests of random tokens (ids away from the vocabulary's ends, where the
    special tokens are) to ``core``, seeded for the same prompts every run."""

    def __init__(self, core: Any, seed: int = 0):
        self.core = core
        self.vocab = core.handle.info.vocab_size
        self.rnd = random.Random(seed)
        self._ids = iter(range(1, 1 << 30))

    def submit(self, tokens: int, max_tokens: int) -> int:
        """Submit a prompt of ``tokens`` tokens; its request id."""
        from runtime.messages import SamplingParams, Submit

        prompt = tuple(self.rnd.randrange(100, self.vocab - 100) for _ in range(tokens))
        request_id = next(self._ids)
        self.core.handle_command(Submit(request_id=request_id, prompt=prompt,
                                        segments=(prompt,), segment_types=("user",),
                                        max_tokens=max_tokens, sampling=SamplingParams()))
        return request_id
