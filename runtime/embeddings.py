"""The embedding model and the thread that runs it: MLX work for ``/v1/embeddings``.

``EmbeddingModel`` wraps what ``mlx_embeddings.load`` returns (a text model of
one of ``FAMILIES`` and its tokenizer): ``tokenize`` texts as the library's own
``generate`` does (the tokenizer's special tokens added), ``embed`` a batch of
token lists in one forward pass (right-padded, with the attention mask; the
model's own pooling and L2 normalisation, its ``text_embeds``).

``EmbeddingWorker.run`` is the body of the one thread that owns the model for
its lifetime: it lowers its own CPU priority (so that on a CPU the chat
engine's steps come first), loads the model (on its own MLX stream), reports it
(``on_ready``), then takes ``EmbedJob``s from a bounded ``queue.Queue``. Jobs
that wait together are served together: their inputs are tokenised and checked
(``ClientError`` for the job whose input is too long or holds an unknown id),
sorted by length and cut into forward passes of at most ``batch_size`` inputs
and ``batch_tokens`` padded tokens. Each job's outcome, an ``EmbedResult`` or
a ``ServerError``, goes back through ``deliver``, one call per round of jobs.
A job whose requester has left (``abandoned``) is skipped; a failure in a
round fails that round's jobs, not the thread. The thread checks
``check_cancelled`` between passes and while idle, so cancelling its trio task
ends it; the jobs it leaves are then answered by the owner (``unanswered``).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from runtime.errors import ClientError, ServerError, Unavailable

log = logging.getLogger(__name__)

# mlx-embeddings' text families whose output's ``text_embeds`` is one pooled,
# normalised vector per input (the others give per-token vectors or need images).
FAMILIES = ("bert", "xlm_roberta", "modernbert", "qwen3", "gemma3_text", "llama_bidirec")
THREAD_NICENESS = 10  # added to the embedding thread's nice value: the engine's steps come first
IDLE_WAIT = 0.05  # seconds the idle thread blocks on its inbox between cancellation checks

EmbedInput = str | tuple[int, ...]


@attrs.frozen(kw_only=True)
class EmbeddingInfo:
    """What the API needs to know of the loaded model."""

    family: str
    dimensions: int
    max_tokens: int  # the most tokens one input may have (the model's positions)
    vocab_size: int


@attrs.frozen(kw_only=True)
class EmbedResult:
    vectors: np.ndarray  # (inputs, dimensions) float32, each of length 1
    prompt_tokens: int


@attrs.frozen(kw_only=True, eq=False)
class EmbedJob:
    """One request's inputs; ``single``: the request sent one input, not an array
    (an error then names ``input``, not ``input[i]``). ``abandon()`` (the requester
    that leaves, on the trio thread) tells the worker to skip it."""

    inputs: tuple[EmbedInput, ...]
    single: bool
    reply: Callable[[EmbedResult | ServerError], None]  # called on the trio thread
    _left: threading.Event = attrs.field(factory=threading.Event, repr=False)

    def abandon(self) -> None:
        self._left.set()

    @property
    def abandoned(self) -> bool:
        return self._left.is_set()

    def param(self, index: int) -> str:
        return "input" if self.single else f"input[{index}]"


@attrs.frozen(kw_only=True)
class BatchFigures:
    """One forward pass, for the metrics."""

    inputs: int
    tokens: int  # real tokens, padding not counted
    seconds: float


def _max_tokens(model, tokenizer) -> int:
    limits = [getattr(model.config, "max_position_embeddings", None)]
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and tokenizer_limit < 10**9:  # not "no limit"
        limits.append(tokenizer_limit)
    known = [n for n in limits if isinstance(n, int) and n > 0]
    if not known:
        raise ValueError("the model states no maximum length (max_position_embeddings)")
    return min(known)


class EmbeddingModel:
    """A loaded embedding model and its tokenizer; use on the thread that loaded it."""

    def __init__(self, model, tokenizer, family: str):
        import mlx.core as mx

        self.model = model
        self.tokenizer = tokenizer
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        self.max_tokens = _max_tokens(model, tokenizer)
        probe = model(mx.array([[self.pad_id]]), attention_mask=mx.ones((1, 1))).text_embeds
        if probe is None or probe.ndim != 2:
            raise ValueError(f"the {family} model gives no pooled text embedding")
        self.info = EmbeddingInfo(
            family=family,
            dimensions=int(probe.shape[-1]),
            max_tokens=self.max_tokens,
            vocab_size=int(model.config.vocab_size),
        )

    @classmethod
    def load(cls, path_or_repo: str) -> EmbeddingModel:
        import mlx_embeddings
        from mlx_embeddings.utils import get_model_path, load_config

        if path_or_repo.startswith(("/", ".", "~")) and not Path(path_or_repo).expanduser().is_dir():
            raise FileNotFoundError(f"no such model directory: {path_or_repo}")
        family = load_config(get_model_path(path_or_repo))["model_type"].replace("-", "_")
        if family not in FAMILIES:
            raise ValueError(
                f"model type {family!r} is not one this server embeds with "
                f"(it serves {', '.join(FAMILIES)})"
            )
        model, tokenizer = mlx_embeddings.load(path_or_repo)
        return cls(model, tokenizer, family)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, special tokens added, as ``mlx_embeddings.generate``."""
        return [list(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """One forward pass over ``token_lists``: their vectors, (n, dimensions) float32."""
        import mlx.core as mx

        width = max(len(ids) for ids in token_lists)
        ids = np.full((len(token_lists), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(token_lists), width), dtype=np.int32)
        for row, tokens in enumerate(token_lists):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        vectors = self.model(mx.array(ids), attention_mask=mx.array(mask)).text_embeds
        return np.array(vectors.astype(mx.float32), copy=True)


def _set_priority(niceness: int | None = None) -> int | None:
    """This thread's nice value set to ``niceness`` (None: its own plus
    ``THREAD_NICENESS``, so that the CPU scheduler puts the chat engine first); returns
    the value it had, to be set back (trio's threads are reused). Linux only: there a
    thread id is a task of its own to ``setpriority``; elsewhere it would name a process."""
    if sys.platform != "linux":
        return None
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, before + THREAD_NICENESS if niceness is None else niceness)
    except OSError as exc:  # not allowed here (setting it back up needs privileges)
        log.debug("the embedding thread's priority stays as it is: %s", exc)
        return None
    return before


def passes(lengths: Sequence[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Indices into ``lengths``, shortest first, cut into forward passes of at most
    ``batch_size`` inputs whose count times the longest is at most ``batch_tokens``
    (an input longer than that alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # sorted: lengths[i] is the longest of current + [i]
        if current and (len(current) >= batch_size or (len(current) + 1) * lengths[i] > batch_tokens):
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


class EmbeddingWorker:
    """The embedding thread's body (``run``); see the module's docstring."""

    def __init__(
        self,
        path_or_repo: str,
        inbox: queue.Queue[EmbedJob],
        *,
        batch_size: int,
        batch_tokens: int,
        on_batch: Callable[[BatchFigures], None] = lambda figures: None,
    ):
        self.path_or_repo = path_or_repo
        self.inbox = inbox
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.on_batch = on_batch  # called on this thread (prometheus-client is thread-safe)
        # The jobs being served now: if the thread ends in the middle of a round
        # (cancelled), its owner answers them with the queued ones.
        self.in_round: list[EmbedJob] = []

    def run(
        self,
        check_cancelled: Callable[[], None],
        on_ready: Callable[[EmbeddingInfo], None],
        deliver: Callable[[list[tuple[EmbedJob, EmbedResult | ServerError]]], None],
    ) -> None:
        """Load, report, then serve jobs until cancelled. A load failure raises."""
        import mlx.core as mx

        niceness = _set_priority()
        try:
            stream = mx.new_stream(mx.default_device())
            with mx.stream(stream):
                model = EmbeddingModel.load(self.path_or_repo)
                on_ready(model.info)
                try:
                    while True:
                        check_cancelled()
                        jobs = self._gather()
                        if jobs:
                            self.in_round = jobs
                            deliver(self._round(model, jobs, check_cancelled))
                            self.in_round = []
                finally:
                    del model
                    mx.clear_cache()
        finally:
            if niceness is not None:
                _set_priority(niceness)

    def _gather(self) -> list[EmbedJob]:
        """The jobs waiting now (blocking up to ``IDLE_WAIT`` for a first), up to about
        one full pass of inputs; the rest wait for the next round."""
        try:
            jobs = [self.inbox.get(timeout=IDLE_WAIT)]
        except queue.Empty:
            return []
        inputs = len(jobs[0].inputs)
        while inputs < self.batch_size:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                break
            jobs.append(job)
            inputs += len(job.inputs)
        return [job for job in jobs if not job.abandoned]

    def _round(
        self, model: EmbeddingModel, jobs: list[EmbedJob], check_cancelled: Callable[[], None]
    ) -> list[tuple[EmbedJob, EmbedResult | ServerError]]:
        """Every job's outcome: a failure here fails this round's jobs, not the thread."""
        try:
            return self._serve(model, jobs, check_cancelled)
        except Exception as exc:
            log.exception("an embedding round failed")
            failure = ServerError(f"the embedding model failed: {type(exc).__name__}: {exc}")
            return [(job, failure) for job in jobs]

    def _serve(
        self, model: EmbeddingModel, jobs: list[EmbedJob], check_cancelled: Callable[[], None]
    ) -> list[tuple[EmbedJob, EmbedResult | ServerError]]:
        outcomes: dict[int, EmbedResult | ServerError] = {}
        items: list[tuple[int, int, list[int]]] = []  # (job, input index, token ids)
        for j, job in enumerate(jobs):
            try:
                token_lists = self._tokens(model, job)
            except ServerError as exc:
                outcomes[j] = exc
                continue
            items += [(j, i, ids) for i, ids in enumerate(token_lists)]
        vectors: dict[tuple[int, int], np.ndarray] = {}
        for indices in passes([len(it[2]) for it in items], self.batch_size, self.batch_tokens):
            check_cancelled()
            batch = [items[k] for k in indices]
            started = time.perf_counter()
            out = model.embed([ids for _, _, ids in batch])
            self.on_batch(BatchFigures(
                inputs=len(batch),
                tokens=sum(len(ids) for _, _, ids in batch),
                seconds=time.perf_counter() - started,
            ))
            for row, (j, i, _) in enumerate(batch):
                vectors[(j, i)] = out[row]
        for j, job in enumerate(jobs):
            if j not in outcomes:
                rows = [vectors[(j, i)] for i in range(len(job.inputs))]
                outcomes[j] = EmbedResult(
                    vectors=np.stack(rows),
                    prompt_tokens=sum(len(ids) for jj, _, ids in items if jj == j),
                )
        return [(job, outcomes[j]) for j, job in enumerate(jobs)]

    def _tokens(self, model: EmbeddingModel, job: EmbedJob) -> list[list[int]]:
        """The job's inputs as token ids, checked against the model (400 naming the input)."""
        texts = [(i, text) for i, text in enumerate(job.inputs) if isinstance(text, str)]
        encoded = {}
        if texts:
            encoded = dict(zip([i for i, _ in texts], model.tokenize([t for _, t in texts]),
                               strict=True))
        out = []
        for i, item in enumerate(job.inputs):
            ids = encoded[i] if i in encoded else list(item)
            if len(ids) > model.max_tokens:
                raise ClientError(
                    f"{job.param(i)} has {len(ids)} tokens; the embedding model takes at most "
                    f"{model.max_tokens}",
                    param=job.param(i),
                    code="context_length_exceeded",
                )
            bad = next((t for t in ids if not 0 <= t < model.info.vocab_size), None)
            if bad is not None:
                raise ClientError(
                    f"{job.param(i)} holds token id {bad}, outside the embedding model's "
                    f"vocabulary (0-{model.info.vocab_size - 1})",
                    param=job.param(i),
                )
            out.append(ids)
        return out


def unanswered(worker: EmbeddingWorker) -> list[EmbedJob]:
    """The jobs a stopped worker leaves: its round's and its inbox's (sync: for cleanup)."""
    jobs, worker.in_round = worker.in_round, []
    inbox = worker.inbox
    while True:
        try:
            jobs.append(inbox.get_nowait())
        except queue.Empty:
            return jobs


def not_loaded(reason: str) -> Unavailable:
    return Unavailable(f"the embedding model is not available: {reason}", retry_after=30)
