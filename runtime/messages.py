"""Every message that crosses a channel or the engine-thread boundary.

One module, like SGLang's ``io_struct.py``: the actors import their vocabulary
from here and nothing else travels between them. All messages are frozen attrs
classes carrying a ``request_id`` where they concern one request.

Directions:
  * Scheduler -> engine thread: ``Submit``, ``Abort``; ModelLoader -> engine
    thread: ``Shutdown`` (to swap models).
  * engine thread -> Scheduler: ``StepOutputs`` (one per engine step) holding
    ``SequenceStarted``, ``PromptProgress``, ``TokenEvent``, ``SequenceAborted``
    and ``SequenceFailed`` events plus ``EngineStats``.
  * engine process -> its proxy thread (``runtime.engine_process``), besides
    the ``StepOutputs``: ``EngineReady``, ``EngineCrashed``, ``EngineExited``.
  * Detokenizer -> Session (through the request's ``Outbox``): ``Delta``,
    ``Progress`` and exactly one terminal ``Finished`` or ``Failed``.
"""

from __future__ import annotations

import enum
import time

import attrs


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"


# ---------------------------------------------------------------- to the engine


@attrs.frozen(kw_only=True)
class SamplingParams:
    """What the engine needs to build a sampler and logits processors."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@attrs.frozen(kw_only=True)
class Submit:
    """Start generating for one request.

    ``segments`` split ``prompt`` at the points where the prompt cache should
    keep a copy (system prompt, conversation, thinking tail); ``segment_types``
    names each segment for the cache's eviction order.
    """

    request_id: int
    prompt: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    segment_types: tuple[str, ...]
    sampling: SamplingParams
    max_tokens: int
    logprobs: bool = False
    top_logprobs: int = 0
    kv_bytes: int = 0  # the Scheduler's estimate of this sequence's KV cache at its longest
    num_draft_tokens: int | None = None  # speculative decoding: None means the server's


@attrs.frozen(kw_only=True)
class Abort:
    request_id: int
    reason: str = "withdrawn"
    posted_at: float = attrs.field(factory=time.monotonic, eq=False)  # abort-latency figures


@attrs.frozen
class Shutdown:
    """Ask the engine loop to return."""


EngineCommand = Submit | Abort | Shutdown


# -------------------------------------------------------------- from the engine


@attrs.frozen(kw_only=True)
class SequenceStarted:
    """The engine took the request; ``cached_tokens`` came from the prompt cache."""

    request_id: int
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen(kw_only=True)
class PromptProgress:
    request_id: int
    done: int
    total: int


@attrs.frozen(kw_only=True)
class TokenEvent:
    """One generated token. A non-None ``finish_reason`` is terminal.

    With ``finish_reason == "stop"`` the token is the end-of-sequence token and
    is not part of the text.
    """

    request_id: int
    token: int
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen(kw_only=True)
class SequenceAborted:
    """Terminal: the sequence left the engine after an ``Abort``."""

    request_id: int


@attrs.frozen(kw_only=True)
class SequenceFailed:
    """Terminal: the engine could not serve this sequence."""

    request_id: int
    message: str
    retryable: bool = False  # the engine stopped, not the request: 503, try again


@attrs.frozen(kw_only=True)
class EngineStats:
    active_sequences: int = 0
    steps: int = 0
    prefill_steps: int = 0  # steps that processed prompt tokens
    busy_seconds: float = 0.0  # time spent stepping (the rest: idle or waiting for commands)
    prompt_cache_entries: int = 0
    prompt_cache_bytes: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_cached_tokens: int = 0
    # Aborts of running sequences: how long each waited in the inbox, and
    # whether it waited for a step in progress (the most is one, by design).
    aborts: int = 0
    abort_wait_ms_total: float = 0.0
    abort_wait_ms_max: float = 0.0
    abort_wait_steps_max: int = 0


@attrs.frozen(kw_only=True)
class StepOutputs:
    """Everything one engine step produced, for all sequences at once."""

    started: tuple[SequenceStarted, ...] = ()
    progress: tuple[PromptProgress, ...] = ()
    tokens: tuple[TokenEvent, ...] = ()
    aborted: tuple[SequenceAborted, ...] = ()
    failed: tuple[SequenceFailed, ...] = ()
    stats: EngineStats = EngineStats()

    def terminal_ids(self) -> set[int]:
        ids = {e.request_id for e in self.tokens if e.finish_reason is not None}
        ids.update(e.request_id for e in self.aborted)
        ids.update(e.request_id for e in self.failed)
        return ids

    def __bool__(self) -> bool:
        return bool(self.started or self.progress or self.tokens or self.aborted or self.failed)


# ------------------------------------- from an engine process (runtime.engine_process)


@attrs.frozen(kw_only=True)
class EngineReady:
    """The engine process loaded its model: what the parent needs of it."""

    model_key: str
    vocab_size: int
    batchable: bool
    kv_bytes_per_token: int
    kv_budget: int
    eos_token_ids: tuple[int, ...]
    pid: int


@attrs.frozen(kw_only=True)
class EngineCrashed:
    """The engine loop is going down with an error (its failures follow)."""

    reason: str


@attrs.frozen(kw_only=True)
class EngineExited:
    """The engine process's last message: ``error`` is None after a ``Shutdown``."""

    error: str | None = None


# --------------------------------------------------------------- to the Session


@attrs.frozen(kw_only=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str


@attrs.frozen(kw_only=True)
class TokenLogprob:
    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen(kw_only=True)
class Delta:
    """New output since the Session last looked (merged if it lagged)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen(kw_only=True)
class Progress:
    done: int
    total: int


@attrs.frozen(kw_only=True)
class Finished:
    finish_reason: str
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the request, if one did


@attrs.frozen(kw_only=True)
class Failed:
    message: str
    status: int = 500
    type: str = "server_error"


Terminal = Finished | Failed
