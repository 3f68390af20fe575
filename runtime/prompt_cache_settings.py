"""The Prompt cache settings: how many KV caches are kept, where, and what is reused.

``PromptCacheSettings`` declares each of them once, with ``setting(...)``
(``runtime.settings``), as ``runtime.config`` declares the rest; ``ServerConfig``
inherits these fields, so every reader (the command line, ``MLX_TRIO_<NAME>``
variables, docs/configuration.md's tables) finds them in it, in the "Prompt
cache" group. Receives nothing and emits nothing: a declaration, read through
``ServerConfig``.
"""

import attrs

from runtime.settings import PROMPT_CACHE, SIZE, complete_settings, setting
from runtime.tuning_settings import TuningSettings


# This module has no ``from __future__ import annotations``: ``complete_settings``
# reads the fields' types (to pick their text format), so they must be real types.
@attrs.frozen(kw_only=True, field_transformer=complete_settings)
class PromptCacheSettings(TuningSettings):
    """The Prompt cache group of ``ServerConfig`` (which inherits these fields, and
    through them the Advanced tuning ones)."""

    prompt_cache_size: int = setting(
        64,
        help="most KV caches kept in the prompt cache (LRUPromptCache max_size)",
        notes="Each conversation's latest turn needs its entry for the next turn to reuse it, "
        "so this should stay above the number of sessions running at once; the byte limit "
        "(`--prompt-cache-bytes`) bounds the memory they take. mlx_lm.server keeps 10, which "
        "evicts the histories of sixteen agent sessions before their next turns. Lower it "
        "only to hold fewer entries whatever their size. 0 keeps none (every response says "
        "`miss; reason=disabled`).",
        group=PROMPT_CACHE,
    )
    prompt_cache_bytes: int | None = setting(
        None,
        help="byte limit of the prompt cache, a size such as 512M or 4GB, shared with the "
        "running sequences' KV caches",
        format=SIZE.or_none(),
        default_text="45 % of the accelerator's memory less the weights (CPU: of the RAM)",
        notes="The limit is shared with the running sequences: after each admission and each "
        "step the cache is trimmed to this value minus the bytes of the batch's KV caches, so "
        "that the batch, its copies as sequences join or leave, and the cache fit the "
        "device's memory together (the default, with the default KV budget: 80 % of what "
        "the weights leave, at most). The bytes counted are those held: sessions over one system "
        "prompt hold its KV once, and it counts once. With no byte limit, sixteen agent sessions of 24k tokens run "
        "an 80 GB H100 out of memory. Raise it only with `--kv-cache-budget-bytes` in mind; a size above the "
        "memory is no limit. The prompt-cache policy decides the evictions (in mlx-lm's order) "
        "and the engine applies them between steps; in a distributed launch every rank evicts "
        "what rank 0's byte counts decide.",
        group=PROMPT_CACHE,
    )
    prompt_cache_min_reuse: int = setting(
        64,
        help="reuse a cached prompt prefix only if it covers at least this many tokens "
        "(a chat template's few opening tokens are not worth copying an entry for; 0: any)",
        minimum=0,
        ours=True,
        notes="0 reuses any, as mlx_lm.server does. A chat template's opening tokens are "
        "shared by almost every prompt, and reusing them copies a whole cache entry to skip "
        "a few tokens of prefill; real shared prefixes (a system prompt, earlier turns) are "
        "longer.",
        group=PROMPT_CACHE,
    )
    shared_prefill_min_tokens: int = setting(
        256,
        help="a request that repeats at least this many tokens of a prompt being prefilled, "
        "not in the prompt cache yet, waits until that prefix is cached and starts from it "
        "instead of computing it again (0: every request computes its own)",
        minimum=0,
        ours=True,
        notes="For sessions that start together over one long system prompt (coding agents): "
        "the prefix is prefilled once, at the end of the system prompt, where the prompt "
        "cache stores a copy; the others then prefill only what follows it. A waiting "
        "request's stream gets keep-alive comments with its leader's progress. Lower it to "
        "share shorter prefixes; 0 turns it off "
        "([performance.md](performance.md#coding-agents-sessions)).",
        group=PROMPT_CACHE,
    )
    aborted_prefill_min_tokens: int = setting(
        256,
        help="a request cancelled while its prompt is prefilled (its client left or timed "
        "out) leaves the part computed so far in the prompt cache when that part is at "
        "least this many tokens, so that the same request sent again resumes from it "
        "(0: an aborted prefill is dropped)",
        minimum=0,
        ours=True,
        notes="Coding agents time out and retry: a first request of 20k-30k tokens can take "
        "minutes to prefill on a laptop, and without this every retry starts from the last "
        "segment the prompt cache holds. The kept part is an ordinary prompt-cache entry, "
        "counted and evicted like the others. Requests that waited behind the aborted one's "
        "prefix (`--shared-prefill-min-tokens`) start from it too.",
        group=PROMPT_CACHE,
    )
    prompt_cache_dir: str | None = setting(
        None,
        help="a folder where the prompt cache also keeps entries on disk (made if missing): "
        "system prompts of 256 tokens or more as they are cached, and entries of 256 tokens "
        "or more that the memory limits evict or that memory holds when the server stops; "
        "they outlive restarts, and a request whose prompt starts with one reads it back "
        "instead of computing it (none: memory only)",
        ours=True,
        notes="For coding agents: their 10k-25k-token system prompts are prefilled once, not "
        "after every restart, and a session that went quiet, or was running when the server "
        "stopped (the newest entries are written for at most 4 s), comes back from disk "
        "rather than being prefilled again. Entries are kept per model (its files' sizes and times) and "
        "per prompt-cache scope. The folder holds the prompts' tokens and KV: keep it "
        "private. Not used by distributed or vision-language models "
        "([architecture.md](architecture.md#the-prompt-cache-on-disk)).",
        group=PROMPT_CACHE,
    )
    prompt_cache_dir_bytes: int = setting(
        20 * 10**9,
        help="the most the prompt cache's entries on disk (`--prompt-cache-dir`) may take, a "
        "size such as 20GB; the least recently used go first",
        format=SIZE,
        above=0,
        ours=True,
        default_text="20G",
        notes="An entry takes its KV cache's bytes: 144 KiB a token for Qwen3-8B in 16 bits, "
        "about 2.9 GB for a 20,000-token prompt.",
        group=PROMPT_CACHE,
    )
    prompt_cache_scope: str = setting(
        "key",
        help="`key`: with API keys set, a request reuses only prompt-cache entries made with "
        "its own key; `shared`: every request reuses every entry",
        choices=("key", "shared"),
        ours=True,
        notes="A shared cache tells one tenant, by its time to first token, what another "
        "sent. A request's `cache_salt` scopes it too ([api.md](api.md#prompt-cache)).",
        group=PROMPT_CACHE,
    )
