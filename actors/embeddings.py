"""The Embeddings actor: the embedding model's thread, its inbox, and the requests' port.

Owns the ``EmbeddingWorker`` thread (``runtime.embeddings``) for the model's
lifetime: ``run`` starts it in one long ``trio.to_thread.run_sync`` (trio waits
for it on cancellation, so no orphan thread keeps the model) and, when it ends,
answers the jobs it left (queued or being served) with a 503. Receives requests through
``embed(inputs, single)``: a job is put on the bounded inbox (``queue.Queue``,
at most ``--max-queued-requests`` jobs: beyond that a 429 with
``Retry-After``), and the request waits for its outcome on a channel of one;
a request that leaves abandons its job (``EmbedJob.abandon``: sync, in cleanup) and the
thread skips it. Emits ``EmbedResult``s (or raises the job's ``ServerError``),
the state ``/health`` reports (``state``, ``reason``, ``info``), and the
counts and batch sizes ``/metrics`` shows (``ServerMetrics``).
"""

from __future__ import annotations

import enum
import functools
import logging
import queue

import trio

from actors.metrics import ServerMetrics
from runtime.embeddings import (
    EmbeddingInfo,
    EmbeddingWorker,
    EmbedInput,
    EmbedJob,
    EmbedResult,
    not_loaded,
    unanswered,
)
from runtime.errors import Overloaded, ServerError, shutting_down

log = logging.getLogger(__name__)

OVERLOAD_RETRY_AFTER = 1  # seconds, as the chat Scheduler's 429
LOAD_WAIT = 600.0  # seconds a request waits for the model to load before a 503


class EmbeddingState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class Embeddings:
    def __init__(
        self,
        model_id: str,
        metrics: ServerMetrics,
        *,
        max_queued: int,
        batch_size: int,
        batch_tokens: int,
    ):
        self.model_id = model_id
        self.metrics = metrics
        self.inbox: queue.Queue[EmbedJob] = queue.Queue(maxsize=max_queued)
        self.worker = EmbeddingWorker(
            model_id,
            self.inbox,
            batch_size=batch_size,
            batch_tokens=batch_tokens,
            on_batch=metrics.observe_embedding_batch,
        )
        self.state = EmbeddingState.LOADING
        self.reason: str | None = None
        self.info: EmbeddingInfo | None = None
        self._settled = trio.Event()  # set once the model is ready or has failed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await trio.to_thread.run_sync(
                functools.partial(
                    self.worker.run,
                    trio.from_thread.check_cancelled,
                    lambda info: trio.from_thread.run_sync(self._ready, info),
                    lambda outcomes: trio.from_thread.run_sync(self._deliver, outcomes),
                ),
                thread_name="mlx-embeddings",
                abandon_on_cancel=False,
            )
        except Exception as exc:
            self.state = EmbeddingState.FAILED
            self.reason = f"{self.model_id}: {type(exc).__name__}: {exc}"
            log.error("the embedding model could not be loaded or run: %s", self.reason)
        finally:
            if self.state is not EmbeddingState.FAILED:
                self.state = EmbeddingState.STOPPED
                self.reason = "the server is shutting down"
            self._settled.set()
            failure = (
                shutting_down() if self.state is EmbeddingState.STOPPED else not_loaded(self.reason)
            )
            self._deliver([(job, failure) for job in unanswered(self.worker)])

    def _ready(self, info: EmbeddingInfo) -> None:
        self.info = info
        self.state = EmbeddingState.READY
        self._settled.set()
        log.info(
            "embedding model %s ready: %s, %d dimensions, at most %d tokens an input",
            self.model_id, info.family, info.dimensions, info.max_tokens,
        )

    @staticmethod
    def _deliver(outcomes: list[tuple[EmbedJob, EmbedResult | ServerError]]) -> None:
        for job, outcome in outcomes:
            job.reply(outcome)

    async def wait_ready(self) -> EmbeddingInfo:
        """The loaded model's description; waits while it loads (503 if it cannot)."""
        if not self._settled.is_set():
            with trio.move_on_after(LOAD_WAIT):
                await self._settled.wait()
        if self.state is EmbeddingState.STOPPED:
            raise shutting_down()
        if self.state is not EmbeddingState.READY or self.info is None:
            raise not_loaded(self.reason or "it is still loading")
        return self.info

    async def embed(self, inputs: tuple[EmbedInput, ...], *, single: bool) -> EmbedResult:
        """The vectors of ``inputs`` (batched with other requests' by the thread)."""
        await self.wait_ready()
        send, receive = trio.open_memory_channel[EmbedResult | ServerError](1)

        def reply(outcome: EmbedResult | ServerError) -> None:
            try:
                send.send_nowait(outcome)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the request left

        job = EmbedJob(inputs=inputs, single=single, reply=reply)
        try:
            self.inbox.put_nowait(job)
        except queue.Full:
            self.metrics.observe_embedding_request("overloaded", 0, 0)
            raise Overloaded(
                "too many embedding requests are waiting; retry later",
                retry_after=OVERLOAD_RETRY_AFTER,
            ) from None
        try:
            with receive:
                outcome = await receive.receive()
        finally:
            job.abandon()  # sync: the thread skips a job whose requester left
        if isinstance(outcome, ServerError):
            self.metrics.observe_embedding_request("error", 0, 0)
            raise outcome
        self.metrics.observe_embedding_request("ok", len(inputs), outcome.prompt_tokens)
        return outcome

    def health(self) -> dict:
        body: dict = {"model": self.model_id, "state": self.state.value}
        if self.info is not None:
            body.update(dimensions=self.info.dimensions, max_tokens=self.info.max_tokens)
        if self.reason is not None and self.state is not EmbeddingState.READY:
            body["reason"] = self.reason
        return body
