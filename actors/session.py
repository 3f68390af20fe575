"""Session: one HTTP request's view of the runtime.

An async context manager. Entering it prepares the prompt (chat template and
tokenizer in a worker thread; in the same thread, right after, the request's
output constraint, if the route gave a ``constrain`` step: structured outputs,
enforced tool choice), registers the request with the Detokenizer and
submits it to the Scheduler, which may refuse with ``Overloaded`` (429) or
``Unavailable`` (503) before any byte of the response is sent. Inside, the
route calls ``receive()`` for the request's events: ``Progress``, ``Delta``,
then exactly one ``Finished`` or ``Failed``.

Exiting, for any reason (normal end, error, the client disconnecting and
trio cancelling the handler), closes it (``close``): synchronously, with no
``await``, because under trio's level-triggered cancellation an ``await`` in
cleanup would raise again. Closing closes the request
(``SessionPort.close_request``: a request still running is aborted, an
``Abort`` goes into the engine's inbox and the sequence leaves the batch at
the next engine step), closes the outboxes and releases the model's lease.

A deadline (the request's ``timeout`` or the server's ``request_timeout``)
aborts the request (``SessionPort.abort_request``, ``AbortReason.DEADLINE``):
it finishes with ``finish_reason: "length"``.

Limits (``fit_max_tokens``): a prompt that leaves no room in the model's
context window is a 400 (``context_length_exceeded``), one whose KV cache
cannot fit the server's budget a 413; ``max_tokens`` is lowered to what the
window and the budget leave, so a huge ``max_tokens`` is served, and the
admission estimate is made with the lowered value.

Images (a chat request's ``image_url`` parts, ``image_params`` naming them):
a text-only model refuses them with a 400 naming the first part, before
they are fetched or decoded; a vision-language model's Session awaits
``load_images()`` and prepares with the model's processor (``vision=``).

Several choices (``n`` > 1): one Submit starts n sequences (the engine
processes the prompt once); each has its own request id and ``Outbox``, and
``receive()`` returns their events tagged with the choice's ``index``.

Cancellation: entering is a checkpoint (the worker-thread call); ``receive()``
raises ``Cancelled`` if the task is cancelled, and waits only when nothing is
pending; exiting is not a checkpoint.

Timing: a Session notes when the request began (entering), when its first
output and its terminal reached it (``RequestTiming``, the response edge: what
the client sees, stop-string hold-back included) and the terminal's token
counts; closing hands the record to ``SessionPort.record_request`` (metrics)
and keeps it as ``timing`` (the access log).

Bursts (``Arrivals``): a Session counts itself while it tokenises, and its
Submit says whether other requests were still on their way
(``Submit.followed``: the engine's admission window then lets the burst start
its prefill together).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import attrs
import trio

from actors.request_timing import RequestTiming
from runtime.errors import ClientError, PayloadTooLarge
from runtime.grammar import ConstraintSpec
from runtime.loaded_model import LoadedModel
from runtime.messages import (
    AbortReason,
    Delta,
    PreparedPrompt,
    Progress,
    PromptCacheOutlook,
    SamplingParams,
    Submit,
    Terminal,
    TextSpec,
)
from runtime.models import ModelKey
from runtime.outbox import Outbox


class Arrivals:
    """Requests on their way to the engine, for ``Submit.followed``; trio thread only.

    ``http``: generation requests the HTTP side is answering that have not sent
    their Submit yet (the API's ``RequestObserver`` counts one in, and out at the
    Submit, through ``RequestTiming.on_submitted``, or at its end);
    ``preparing``: Sessions templating or tokenising, from HTTP or not.
    """

    def __init__(self) -> None:
        self.http = 0
        self.preparing = 0

    def others_pending(self, *, counted: bool) -> bool:
        """Asked by a Session about to submit (``counted``: its own request is one of
        ``http``): are other requests on their way?"""
        return self.preparing > 0 or self.http - (1 if counted else 0) > 0


class SessionPort(Protocol):
    """What a Session needs of the runtime (``actors.system.Runtime`` provides it)."""

    tokenize_limiter: trio.CapacityLimiter
    arrivals: Arrivals

    @property
    def default_model(self) -> ModelKey: ...

    @property
    def kv_budget(self) -> int | None:
        """Bytes of KV cache the engine's sequences may hold together (None: no limit)."""

    async def acquire(self, key: ModelKey) -> LoadedModel:
        """Wait until ``key`` is loaded and lease it (404 / 503)."""

    def release(self) -> None:
        """Give the lease back; synchronous."""

    def drain_before(self, deadline: float) -> None:
        """The HTTP server cuts open requests at ``deadline``: end them properly before."""

    def allocate_id(self) -> int: ...

    def open_request(
        self,
        submit: Submit,
        spec: TextSpec,
        outboxes: Sequence[Outbox],
        handle: LoadedModel,
        *,
        template_key: str | None = None,
        conversation_keys: tuple[str, ...] = (),
    ) -> PromptCacheOutlook:
        """Register each of ``submit.request_ids`` with the Detokenizer (with its
        outbox) and submit to the Scheduler (429 / 413 / 503); returns what the
        prompt cache expects the lookup to reuse, or why not."""

    def close_request(self, request_id: int) -> None:
        """The Session is done with the request: forget it everywhere, aborting it
        (``AbortReason.CLOSED``) if it still runs; synchronous and idempotent."""

    def abort_request(self, request_id: int, reason: AbortReason) -> None:
        """Stop the request early; it still ends with its terminal (``DEADLINE``:
        ``Finished`` with "length")."""

    def record_request(self, timing: RequestTiming) -> None:
        """The Session left: its timing and tokens (metrics); synchronous, never raises."""


class Session:
    def __init__(
        self,
        runtime: SessionPort,
        *,
        prepare: Callable[[object], PreparedPrompt],
        sampling: SamplingParams,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        tools: Sequence[Mapping[str, object]] | None = None,
        markup: bool = True,
        logprobs: bool = False,
        top_logprobs: int = 0,
        timeout: float | None = None,
        model: ModelKey | None = None,
        num_draft_tokens: int | None = None,
        constrain: Callable[[object, PreparedPrompt], ConstraintSpec | None] | None = None,
        n: int = 1,
        prompt_param: str = "messages",
        prepare_inline: bool = False,
        cache_scope: str = "",
        image_params: tuple[str, ...] = (),
        load_images: Callable[[], Awaitable[tuple]] | None = None,
    ):
        """``prepare(tokenizer)`` makes the prompt (``prepare(tokenizer, vision=(processor,
        model_type, images))`` when the request has images); ``constrain(tokenizer, prompt)``
        (optional) the ``Submit.constraint`` (``None``: free output). Both run
        in a worker thread, tokenizer-only (``prepare_inline``: on the trio
        thread, for prompts short enough that a thread's two hand-overs of the
        GIL cost more than the templating; a ``constrain`` with a ``recent(tokenizer,
        prompt)`` that finds the spec compiled lately then stays there too, and one
        that must compile goes to the worker thread); a
        ``ClientError`` from either is a 400 before any byte is sent. ``n``:
        choices generated from the prompt; ``prompt_param``: the request field a
        too-long prompt is blamed on; ``cache_scope``: the prompt cache's partition
        this request reads and fills (``Submit.cache_scope``)."""
        self._runtime = runtime
        self._prepare = prepare
        self._constrain = constrain
        self._prepare_inline = prepare_inline and not image_params
        self._image_params = image_params
        self._load_images = load_images
        self.sampling = sampling
        self.max_tokens = max_tokens
        self._stop = stop
        self._tools = tools
        self._markup = markup
        self._logprobs = logprobs
        self._top_logprobs = top_logprobs
        self._timeout = timeout
        self._model = model
        self._num_draft_tokens = num_draft_tokens
        self.n = n
        self._prompt_param = prompt_param
        self._cache_scope = cache_scope
        self._leased = False
        self._deadline = float("inf")
        self._bell = trio.Event()  # rung by any choice's outbox (n > 1)
        self.outboxes = tuple(Outbox(self._ring if n > 1 else None) for _ in range(n))
        self.outbox = self.outboxes[0]
        self.request_id: int | None = None  # choice 0's
        self.request_ids: tuple[int, ...] = ()
        self.prompt: PreparedPrompt | None = None
        # Predicted when the request was submitted (the engine's actual lookup
        # comes with the usage: ``Usage.cached_tokens``, ``cache_miss_reason``).
        self.prompt_cache: PromptCacheOutlook | None = None
        self.timing = RequestTiming()
        self._recorded = False

    async def __aenter__(self) -> Session:
        self.timing.started = time.monotonic()
        key = self._model or self._runtime.default_model
        handle = await self._runtime.acquire(key)
        self._leased = True
        try:
            return await self._enter(handle, key)
        except BaseException:
            self._leased = False
            self._runtime.release()
            raise

    async def _enter(self, handle: LoadedModel, key: ModelKey) -> Session:
        _check_vocabulary(self.sampling, handle.info.vocab_size)
        prepare = self._prepare
        if self._image_params:
            if handle.info.vision_family is None or self._load_images is None:
                param = self._image_params[0]
                raise ClientError(f"{param}: an image content part needs a vision-language model; "
                                  f"the model {handle.info.model_key!r} is text-only", param=param)
            images = await self._load_images()
            vision = (handle.processor, handle.info.vision_family, images)
            prepare = functools.partial(self._prepare, vision=vision)
        if self._prepare_inline:
            self.prompt = prepare(handle.tokenizer)
            constraint = await self._constrain_inline(handle.tokenizer, self.prompt)
        else:
            self.prompt, constraint = await self._in_worker(
                self._prepare_and_constrain, prepare, handle.tokenizer)
        prompt = self.prompt
        if constraint is not None and key.draft is not None:
            raise ClientError(
                "structured outputs and tool_choice cannot be enforced with speculative "
                "decoding (a draft model)",
                param=getattr(constraint, "param", None),
            )
        vocab_size = handle.info.vocab_size
        if prompt.tokens and not 0 <= min(prompt.tokens) <= max(prompt.tokens) < vocab_size:
            raise ClientError(
                f"prompt token ids must be in 0..{vocab_size - 1}", param="prompt"
            )
        prompt_tokens = len(prompt.tokens)
        max_tokens = fit_max_tokens(
            self.max_tokens,
            prompt_tokens=prompt_tokens,
            window=handle.info.context_window,
            kv_bytes_per_token=handle.info.kv_bytes_per_token,
            kv_budget=self._runtime.kv_budget,
            choices=self.n,
            param=self._prompt_param,
        )
        spec = TextSpec(
            stop=self._stop,
            tools=None if self._tools is None else tuple(self._tools),
            markup=self._markup,
            initial_state=prompt.initial_state,
            prompt_tokens=prompt_tokens,
        )
        ids = tuple(self._runtime.allocate_id() for _ in range(self.n))
        submit = Submit(
            request_id=ids[0],
            choice_ids=ids[1:],
            prompt=prompt.tokens,
            segments=prompt.plan.segments,
            segment_types=prompt.plan.segment_types,
            sampling=self.sampling,
            max_tokens=max_tokens,
            logprobs=self._logprobs or self._top_logprobs > 0,
            top_logprobs=self._top_logprobs,
            kv_bytes=handle.info.kv_bytes_per_token * (prompt_tokens + max_tokens) * self.n,
            kv_bytes_per_token=handle.info.kv_bytes_per_token,
            num_draft_tokens=self._num_draft_tokens,
            constraint=constraint,
            cache_scope=self._cache_scope,
            vision=prompt.vision,
            followed=self._runtime.arrivals.others_pending(
                counted=self.timing.on_submitted is not None
            ),
        )
        self.prompt_cache = self._runtime.open_request(
            submit,
            spec,
            self.outboxes,
            handle,
            template_key=prompt.template_key,
            conversation_keys=prompt.conversation_keys,
        )
        self.request_id = submit.request_id
        self.request_ids = submit.request_ids
        self.timing.submitted = time.monotonic()
        if self.timing.on_submitted is not None:
            self.timing.on_submitted()
        if self._timeout is not None:
            self._deadline = trio.current_time() + self._timeout
        return self

    async def _constrain_inline(self, tokenizer, prompt: PreparedPrompt) -> ConstraintSpec | None:
        if self._constrain is None:
            return None
        recent = getattr(self._constrain, "recent", None)
        spec = recent(tokenizer, prompt) if recent is not None else None
        if spec is not None:
            return spec
        return await self._in_worker(self._constrain, tokenizer, prompt)

    async def _in_worker(self, fn, *args):
        """``fn(*args)`` in a tokenizer worker thread, counted as on its way meanwhile."""
        self._runtime.arrivals.preparing += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._runtime.tokenize_limiter)
        finally:
            self._runtime.arrivals.preparing -= 1

    def _prepare_and_constrain(self, prepare, tokenizer) -> tuple[PreparedPrompt, ConstraintSpec | None]:
        prompt = prepare(tokenizer)
        constraint = self._constrain(tokenizer, prompt) if self._constrain is not None else None
        return prompt, constraint

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the request, the outboxes and the lease; idempotent and synchronous."""
        # Synchronous on purpose: see the module docstring.
        for request_id in self.request_ids:
            self._runtime.close_request(request_id)
        self.request_ids = ()
        self.request_id = None
        for outbox in self.outboxes:
            outbox.close()
        if self._leased:
            self._leased = False
            self._runtime.release()
            if not self._recorded:
                self._recorded = True
                self._runtime.record_request(self.timing)

    def server_closing(self, deadline: float) -> None:
        """The HTTP server will cut this request at ``deadline`` (it is shutting down)."""
        self._runtime.drain_before(deadline)

    async def receive(self) -> tuple[Progress | Delta | Terminal, ...]:
        """The next events; raises ``trio.EndOfChannel`` after the terminal one.

        Past the request's deadline the request is finished with "length" (its
        text so far, then the terminal): a deadline never truncates a stream.
        """
        items = await self._receive()
        self.timing.note(items, time.monotonic())
        return items

    async def _receive(self) -> tuple[Progress | Delta | Terminal, ...]:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._deadline == float("inf"):  # no deadline: no cancel scope per chunk
            return await self._get()
        if trio.current_time() < self._deadline:
            with trio.move_on_at(self._deadline):
                return await self._get()
        # Past the deadline, even if events are pending (a slow reader): finish now.
        self._deadline = float("inf")
        for request_id in self.request_ids:
            self._runtime.abort_request(request_id, AbortReason.DEADLINE)
        return await self._get()

    async def _get(self) -> tuple[Progress | Delta | Terminal, ...]:
        if self.n == 1:
            return await self.outbox.get()
        while True:
            items = []
            for index, outbox in enumerate(self.outboxes):
                for item in outbox.take():
                    if isinstance(item, Progress):  # the shared prompt's: choice 0 reports it
                        if index == 0:
                            items.append(item)
                    else:
                        items.append(attrs.evolve(item, index=index))
            if items:
                return tuple(items)
            if all(outbox.finished for outbox in self.outboxes):
                raise trio.EndOfChannel
            await self._bell.wait()
            self._bell = trio.Event()

    def _ring(self) -> None:
        self._bell.set()


def fit_max_tokens(
    requested: int,
    *,
    prompt_tokens: int,
    window: int | None,
    kv_bytes_per_token: int = 0,
    kv_budget: int | None = None,
    choices: int = 1,
    param: str = "messages",
) -> int:
    """The ``max_tokens`` a sequence runs with: ``requested`` lowered to what the
    context window and the KV budget leave after the prompt.

    Raises a 400 (``context_length_exceeded``) when the prompt leaves no room in
    the window for one token, and a 413 when ``choices`` copies of it cannot fit
    the KV budget with one token each."""
    limit = requested
    if window is not None:
        if prompt_tokens >= window:
            raise ClientError(
                f"This model's maximum context length is {window} tokens. However, your "
                f"{param} resulted in {prompt_tokens} tokens, which leaves no room for a reply "
                f"(at least one token). Please reduce the length of the {param}.",
                param=param,
                code="context_length_exceeded",
            )
        limit = min(limit, window - prompt_tokens)
    if kv_budget and kv_bytes_per_token:
        room = kv_budget // (kv_bytes_per_token * choices)  # tokens each choice may hold
        if prompt_tokens >= room:
            copies = f" x {choices} choices" if choices > 1 else ""
            need = kv_bytes_per_token * (prompt_tokens + 1) * choices
            raise PayloadTooLarge(
                f"the {param} ({prompt_tokens} tokens{copies}) need about {need / 1e6:.1f} MB of "
                f"KV cache with room for one more token, more than the server's budget of "
                f"{kv_budget / 1e6:.1f} MB; send a shorter prompt",
                param=param,
            )
        limit = min(limit, room - prompt_tokens)
    return limit


def _check_vocabulary(sampling: SamplingParams, vocab_size: int) -> None:
    """Values that are only wrong for this model: 400 before they reach the engine."""
    if sampling.top_k >= vocab_size and sampling.top_k > 0:
        raise ClientError(
            f"top_k must be smaller than the vocabulary size ({vocab_size})", param="top_k"
        )
    for token, _ in sampling.logit_bias:
        if not 0 <= token < vocab_size:
            raise ClientError(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )
