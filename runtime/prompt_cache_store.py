"""The engine's prompt cache: mlx-lm's ``LRUPromptCache`` with a reuse floor.

Owned by the engine (thread or process) like the rest of MLX; ``EngineCore``
calls ``fetch_nearest_cache`` for every admitted request and ``insert_cache``
for every finished sequence and cached prompt segment.

``min_reuse_tokens``: a cached prefix shorter than this is not reused. A chat
template's opening tokens (``<|im_start|>user\\n``, a Llama header) are common
to almost every prompt, so without a floor nearly every request "hits" some
entry for a handful of tokens. mlx-lm then searches the whole trie below that
prefix for the shortest entry (about 1.5 ms a request with ten 250-token
entries, in pure Python), deep-copies that entry (hundreds of tokens in every
layer) and trims it, to skip a few tokens of prefill. With the floor, a walk
down the trie along the prompt (no copies, no subtree search) says how many
tokens any entry shares with it; below the floor the request is a miss at
once, at or above it mlx-lm's own fetch runs unchanged.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import LRUPromptCache

from runtime.mlx_lm_internals import shared_prefix_length


class PromptCacheStore(LRUPromptCache):
    """``LRUPromptCache`` that does not reuse prefixes shorter than ``min_reuse_tokens``."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, min_reuse_tokens: int = 0):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.min_reuse_tokens = min_reuse_tokens

    def shared_prefix(self, model: Any, tokens: list[int]) -> int:
        """How many leading ``tokens`` some cached entry shares: at most what a fetch reuses."""
        shared = shared_prefix_length(self, model, tokens)
        # Another mlx-lm layout (shared is None): no shortcut, let the fetch decide.
        return len(tokens) if shared is None else shared

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        if self.min_reuse_tokens > 0 and self.shared_prefix(model, tokens) < self.min_reuse_tokens:
            return None, tokens
        return super().fetch_nearest_cache(model, tokens)
