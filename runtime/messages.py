"""Every message on a request's path, between actors, threads and processes.

One module, like SGLang's ``io_struct.py``: the actors import their vocabulary
from here (and an engine's start and loss from ``runtime.lifecycle``).
Messages are frozen attrs classes with concrete field types, carrying a
``request_id`` where they concern one request.

Directions:
  * Session -> worker thread -> Session: a ``PreparedPrompt`` (tokens and the
    prompt cache's ``SegmentPlan``); Session -> Detokenizer: a ``TextSpec``.
  * Scheduler -> engine: ``Submit``, ``Abort`` (with its ``AbortReason``), and
    the prompt-cache policy's ``EvictCache``; ModelLoader -> engine:
    ``Shutdown`` (to swap models).
  * engine -> Scheduler (through ``runtime.handover``): ``StepOutputs`` (one
    per engine step) holding ``SequenceStarted``, ``PromptProgress``,
    ``TokenEvent``, ``SequenceAborted`` and ``SequenceFailed`` events, the
    prompt cache's ``CacheEntryStored`` / ``CacheEntryRemoved`` and
    ``EngineStats``.
  * Scheduler -> Detokenizer: the same ``StepOutputs``, with
    ``SequenceStarted.miss_reason`` filled in by the prompt-cache policy.
  * prompt-cache policy -> Session: a ``PromptCacheOutlook`` when it opens.
  * Detokenizer -> Session (through the request's ``Outbox``): ``Delta``,
    ``Progress`` and exactly one ``Terminal``: ``Finished`` or ``Failed``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping

import attrs

from runtime.errors import ServerError
from runtime.grammar import ConstraintSpec
from runtime.vision import VisionInputs


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"


class CacheMissReason(enum.StrEnum):
    """Why a request reused nothing from the prompt cache (docs/api.md#prompt-cache)."""

    DISABLED = "disabled"  # --prompt-cache-size 0
    NO_ENTRY = "no_entry"  # no entry shares a token with the prompt
    BELOW_FLOOR = "below_floor"  # one does, but fewer than --prompt-cache-min-reuse tokens
    TEMPLATE_ARGS = "template_args"  # this conversation is cached, rendered with other args
    EVICTED = "evicted"  # the entry that would have served it was evicted for the budget
    ENGINE_RESTARTED = "engine_restarted"  # it was lost with the engine (crash, model swap)
    NOT_REUSABLE = "not_reusable"  # an entry matched, but its cache cannot be cut to the prefix


# ------------------------------------------------------ prepared on the trio side


@attrs.frozen(kw_only=True)
class SegmentPlan:
    """Where in a prompt the engine keeps a copy of the KV cache.

    ``segments`` concatenate to the prompt; ``segment_types`` ("system",
    "user", "assistant") name each for the prompt cache's eviction order."""

    segments: tuple[tuple[int, ...], ...]
    segment_types: tuple[str, ...]


@attrs.frozen(kw_only=True)
class PreparedPrompt:
    """A request's prompt tokens, from the chat template and tokenizer."""

    tokens: tuple[int, ...]
    plan: SegmentPlan
    initial_state: str = "normal"  # "reasoning" when the prompt opens a thinking block
    # What the prompt cache's explanation compares (runtime.prompts): a hash of
    # the chat template's arguments, and one hash per message prefix.
    template_key: str | None = None
    conversation_keys: tuple[str, ...] = ()
    vision: VisionInputs | None = None  # the prompt's images (picklable)


@attrs.frozen(kw_only=True)
class TextSpec:
    """How one request's tokens become text (the Detokenizer's per-request settings)."""

    stop: tuple[str, ...] = ()
    tools: tuple[Mapping[str, object], ...] | None = None  # the request's, for the tool parser
    markup: bool = True  # chat: split reasoning / tool calls; text completions: raw text
    initial_state: str = "normal"
    prompt_tokens: int = 0


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
    kv_bytes_per_token: int = 0  # one choice's KV cache per token (0: unknown)
    num_draft_tokens: int | None = None  # speculative decoding: None means the server's
    # Structured outputs / tool choice (picklable), or None: free output
    constraint: ConstraintSpec | None = None
    # n > 1: the request ids of choices 1..n-1. The engine prefills the prompt
    # once and starts each from a copy of choice 0's cache (runtime.engine.choices).
    choice_ids: tuple[int, ...] = ()
    # Others were on their way (received, or being templated) when this one was sent:
    # an idle engine holds it within the admission window, to prefill the burst together.
    followed: bool = False
    # The prompt cache's partition this request reads and fills ("": the shared one).
    # Scopes never reuse each other's entries (a shared prefix cache would tell one
    # tenant, by its time to first token, what another sent).
    cache_scope: str = ""
    vision: VisionInputs | None = None  # a vision-language model's images

    @property
    def request_ids(self) -> tuple[int, ...]:
        """Every sequence this Submit starts: choice 0 (``request_id``), then the others."""
        return (self.request_id, *self.choice_ids)


class AbortReason(enum.StrEnum):
    """Why a request is stopped before the engine ends it (``abort``)."""

    CLOSED = "closed"  # its Session closed: the client left, or read its end
    DEADLINE = "deadline"  # its timeout passed: it finishes with "length"
    SHUTDOWN = "shutdown"  # the server is stopping: it fails with a 503
    STOP_STRING = "stop_string"  # its text reached a stop string: it finishes with "stop"
    # The KV budget ran short: it resumes from its tokens so far (actors.kv_reservations)
    PREEMPTED = "preempted"


@attrs.frozen(kw_only=True)
class Abort:
    """Take a sequence out of the engine (it ends with ``SequenceAborted``)."""

    request_id: int
    reason: AbortReason = AbortReason.CLOSED
    posted_at: float = attrs.field(factory=time.monotonic, eq=False)  # abort-latency figures


@attrs.frozen(kw_only=True)
class EvictCache:
    """The prompt-cache policy's decision: drop these prompt-cache entries (ids the engine gave)."""

    entry_ids: tuple[int, ...]


@attrs.frozen
class Shutdown:
    """Ask the engine loop to return."""


EngineCommand = Submit | Abort | EvictCache | Shutdown


# -------------------------------------------------------------- from the engine


@attrs.frozen(kw_only=True)
class SequenceStarted:
    """The engine took the request; ``cached_tokens`` came from the prompt cache."""

    request_id: int
    prompt_tokens: int
    cached_tokens: int
    batch_kv_bytes: int = 0  # the batch's KV-cache bytes right after it joined
    miss_reason: CacheMissReason | None = None  # set by the prompt-cache policy (trio side)
    # Seconds it waited before the engine inserted it: in the engine (its admission
    # window, a shared prefix's leader), and the Scheduler adds its queue's (a slot, the
    # KV budget). None where not known (a resumed sequence's start is not the client's).
    queued_seconds: float | None = None


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
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

    def __reduce__(self):
        # Every step pickles one per row (engine process -> server): by position, not
        # attrs' field-name dict (a third of the time, two thirds of the bytes).
        return _token_event, (
            self.request_id,
            self.token,
            self.finish_reason,
            self.logprob,
            self.top_logprobs,
        )


def _token_event(request_id, token, finish_reason, logprob, top_logprobs) -> TokenEvent:
    """Unpickles a ``TokenEvent`` (see its ``__reduce__``)."""
    return TokenEvent(
        request_id=request_id,
        token=token,
        finish_reason=finish_reason,
        logprob=logprob,
        top_logprobs=top_logprobs,
    )


@attrs.frozen(kw_only=True)
class SequenceAborted:
    """Terminal: the sequence left the engine after an ``Abort``."""

    request_id: int


@attrs.frozen(kw_only=True)
class SequenceFailed:
    """Terminal: the engine could not serve this sequence."""

    request_id: int
    message: str
    retryable: bool = False  # the engine stopped or ran out of memory, not the request: 503


# Upper bounds of the engine's step histograms (Prometheus ``le``; +Inf implied), in EngineStats.
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@attrs.frozen(kw_only=True)
class CacheEntryStored:
    """The engine's prompt cache took an entry (``request_id``: the sequence it came from)."""

    entry_id: int
    request_id: int | None
    tokens: tuple[int, ...]
    nbytes: int
    cache_type: str  # "system", "user" or "assistant": the eviction order's classes
    trimmable: bool  # its cache can be cut to a shorter prefix
    # The shared spans its KV lies in, as (span id, bytes), first to last: entries over
    # one system prompt name the same first span, held once. (): whole arrays of its
    # own, ``nbytes`` of them.
    spans: tuple[tuple[int, int], ...] = ()


@attrs.frozen(kw_only=True)
class CacheEntryRemoved:
    """An entry left by the store's own rules: ``replaced`` (the same tokens were
    stored again) or ``superseded`` (a longer entry that can be cut covers it)."""

    entry_id: int
    reason: str


CacheEvent = CacheEntryStored | CacheEntryRemoved


@attrs.frozen(kw_only=True)
class EngineStats:
    active_sequences: int = 0
    steps: int = 0
    prefill_steps: int = 0  # steps that processed prompt tokens
    busy_seconds: float = 0.0  # time spent stepping (the rest: idle or waiting for commands)
    prompt_cache_entries: int = 0
    prompt_cache_bytes: int = 0
    batch_kv_bytes: int = 0  # the running batch's KV caches after the step
    prompt_cache_hits: int = 0
    prompt_cache_cached_tokens: int = 0
    # Aborts of running sequences: inbox waits, and waits for a step in progress (at most one)
    aborts: int = 0
    abort_wait_ms_total: float = 0.0
    abort_wait_ms_max: float = 0.0
    abort_wait_steps_max: int = 0
    # Aborted prompts whose part computed so far went to the prompt cache, and its tokens
    aborted_prefills_kept: int = 0
    aborted_prefill_tokens_kept: int = 0
    # The prompt cache's disk tier (--prompt-cache-dir): what it holds, entries written
    # to it, and entries read back for requests (with their tokens)
    prompt_cache_disk_entries: int = 0
    prompt_cache_disk_bytes: int = 0
    prompt_cache_disk_writes: int = 0
    prompt_cache_disk_reads: int = 0
    prompt_cache_disk_read_tokens: int = 0
    # Decode batches stepping rows now (runtime.decode_lanes), and lanes opened beside the
    # first since the batch generator was made
    decode_lanes: int = 0
    decode_lanes_opened: int = 0
    # Decoding batches' prefixes held once for their sessions (runtime.held_prefix): their
    # bytes, and what that saves against each session holding its own copy
    held_prefix_bytes: int = 0
    shared_kv_bytes: int = 0
    # Tokens: of the prompts admitted (cached ones included), and generated.
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0  # of those, fed to the model (not from a cache or a copy)
    generated_tokens: int = 0
    # Steps with sequences in the batch: their duration and batch size, counted per
    # bucket (one count per bound of STEP_SECONDS_BUCKETS / BATCH_SIZE_BUCKETS, then +Inf).
    step_seconds_counts: tuple[int, ...] = ()
    step_seconds_sum: float = 0.0
    batch_size_counts: tuple[int, ...] = ()
    batch_size_sum: int = 0


@attrs.frozen(kw_only=True)
class StepOutputs:
    """Everything one engine step produced, for all sequences at once."""

    started: tuple[SequenceStarted, ...] = ()
    progress: tuple[PromptProgress, ...] = ()
    tokens: tuple[TokenEvent, ...] = ()
    aborted: tuple[SequenceAborted, ...] = ()
    failed: tuple[SequenceFailed, ...] = ()
    cache_events: tuple[CacheEvent, ...] = ()  # in the order they happened
    stats: EngineStats = EngineStats()

    def terminal_ids(self) -> set[int]:
        ids = {e.request_id for e in self.tokens if e.finish_reason is not None}
        ids.update(e.request_id for e in self.aborted)
        ids.update(e.request_id for e in self.failed)
        return ids

    def __bool__(self) -> bool:
        return bool(
            self.started
            or self.progress
            or self.tokens
            or self.aborted
            or self.failed
            or self.cache_events
        )


# --------------------------------------------------------------- to the Session


@attrs.frozen(kw_only=True)
class PromptCacheOutlook:
    """The prompt-cache policy's explanation of one request's prompt-cache lookup.

    Given when the request is opened (a prediction, for the response's header)
    and again when it starts (``SequenceStarted.miss_reason``, ``Usage``)."""

    reused_tokens: int
    miss_reason: CacheMissReason | None  # None: a hit
    shared_tokens: int = 0  # the longest prefix any entry shares with the prompt


@attrs.frozen(kw_only=True)
class ToolCall:
    name: str  # "" on the later parts of a call streamed in parts (which share its id)
    arguments: str  # JSON text, as OpenAI sends it (of a part: the next piece of it)
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
    cache_miss_reason: CacheMissReason | None = None  # why cached_tokens is 0
    # Seconds it waited before the engine inserted it (``SequenceStarted.queued_seconds``):
    # the access log's and /metrics' figure, not the API's.
    queued_seconds: float | None = None

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
    index: int = 0  # the choice (n > 1)


@attrs.frozen(kw_only=True)
class Progress:
    done: int
    total: int


@attrs.frozen(kw_only=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the request, if one did
    index: int = 0  # the choice (n > 1)


@attrs.frozen(kw_only=True)
class Failed:
    message: str
    status: int = 500
    type: str = "server_error"
    retry_after: int | None = None  # seconds, for a 429 or 503
    usage: Usage | None = None  # what was generated before the failure, if it had started
    index: int = 0  # the choice (n > 1)

    @classmethod
    def of(cls, error: ServerError) -> Failed:
        """A started request ends with the answer ``error`` gives a new one."""
        return cls(
            message=error.message, status=error.status, type=error.type,
            retry_after=error.retry_after,
        )


Terminal = Finished | Failed
