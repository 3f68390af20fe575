"""The bodies the OpenAI endpoints answer with: chat and text completions, their chunks, models,
embeddings.

attrs classes, filled by the renderers (``api.renderers``) and by
``api.routes.models``, and unstructured by ``api.convert.unstructure``
(the embeddings list is written straight to JSON by ``api.routes.embeddings``,
its floats too many for cattrs; these classes document its shape): a
field with a ``None`` default is left out while ``None``; a field without a
default is always sent (``content: null``, ``finish_reason: null``,
``logprobs: null``). ``api.openapi`` documents the same classes. Receives
the runtime's ``Usage`` (``UsageOut.of``, ``PromptCacheOut.of``); emits
nothing itself. Our one extension field, ``prompt_cache``
(``PromptCacheOut``), is in the body and in a stream's chunk that carries
the ``finish_reason``.
"""

from __future__ import annotations

import attrs

from runtime.messages import Usage


@attrs.frozen(kw_only=True)
class PromptTokensDetails:
    cached_tokens: int


@attrs.frozen(kw_only=True)
class PromptCacheOut:
    """How much of the prompt the prompt cache covered and, if nothing, why (docs/api.md)."""

    reused_tokens: int
    miss_reason: str | None

    @classmethod
    def of(cls, usage: Usage) -> PromptCacheOut:
        reason = None if usage.cached_tokens else usage.cache_miss_reason
        return cls(reused_tokens=usage.cached_tokens, miss_reason=reason)


@attrs.frozen(kw_only=True)
class UsageOut:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, usage: Usage) -> UsageOut:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        )


@attrs.frozen(kw_only=True)
class FunctionOut:
    arguments: str
    name: str | None = None  # None on a streamed call's later chunks


@attrs.frozen(kw_only=True)
class ToolCallOut:
    function: FunctionOut
    id: str | None = None  # None on a streamed call's later chunks
    type: str | None = None
    index: int | None = None


@attrs.frozen(kw_only=True)
class TopLogprob:
    """One of the most likely tokens: OpenAI's fields and mlx_lm.server's ``id``."""

    id: int  # the token id (a key for ``logit_bias``); ``token`` is its text
    token: str
    logprob: float
    bytes: list[int]


@attrs.frozen(kw_only=True)
class ChatTokenLogprob:
    """The sampled token: OpenAI's fields and mlx_lm.server's ``id``."""

    id: int
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


@attrs.frozen(kw_only=True)
class ChatLogprobs:
    content: list[ChatTokenLogprob]


@attrs.frozen(kw_only=True)
class ChatMessageOut:
    role: str
    content: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


@attrs.frozen(kw_only=True)
class ChatDelta:
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


@attrs.frozen(kw_only=True)
class ChatChoice:
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None


@attrs.frozen(kw_only=True)
class ChatChunkChoice:
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


@attrs.frozen(kw_only=True)
class ChatCompletion:
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: UsageOut
    prompt_cache: PromptCacheOut | None = None


@attrs.frozen(kw_only=True)
class ChatCompletionChunk:
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None
    prompt_cache: PromptCacheOut | None = None


@attrs.frozen(kw_only=True)
class TextLogprobs:
    """OpenAI's legacy completions logprobs (``logprobs: N``), and the sampled tokens' ids.

    ``token_ids`` (ours) is parallel to ``tokens``; the ``top_logprobs`` maps
    are keyed by token text, which has no room for ids (``logprobs: true`` with
    ``top_logprobs`` gives the alternatives' ids).
    """

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]
    token_ids: list[int]


@attrs.frozen(kw_only=True)
class TextChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: TextLogprobs | ChatLogprobs | None  # ChatLogprobs for ``logprobs: true``


@attrs.frozen(kw_only=True)
class TextCompletion:
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: UsageOut | None = None
    prompt_cache: PromptCacheOut | None = None


@attrs.frozen(kw_only=True)
class ModelCard:
    id: str
    object: str
    created: int
    owned_by: str
    context_length: int | None = None  # the served model's context window, once loaded
    max_model_len: int | None = None  # the same, as vLLM names it


@attrs.frozen(kw_only=True)
class ModelList:
    object: str
    data: list[ModelCard]


@attrs.frozen(kw_only=True)
class EmbeddingOut:
    """One input's vector: floats, or with ``encoding_format: base64`` the base64 of its
    little-endian float32 bytes (as OpenAI sends it)."""

    object: str
    index: int
    embedding: list[float] | str


@attrs.frozen(kw_only=True)
class EmbeddingUsage:
    prompt_tokens: int
    total_tokens: int


@attrs.frozen(kw_only=True)
class EmbeddingList:
    object: str
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingUsage
