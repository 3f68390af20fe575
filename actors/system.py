"""The actor system: three actors under one nursery, wired with bounded channels.

::

    Session --acquire/release--> ModelLoader: runs the engine, reports ModelReady / ModelLost
    Session --open_request/abort_request/close_request (sync)--> Runtime --ports--> actors
    Runtime --open/abort (DetokenizerPort)--> Detokenizer --abort (SchedulerPort)--> Scheduler
    Runtime --submit (SchedulerPort)--> Scheduler --Submit/Abort/EvictCache (inbox)--> engine
    engine --StepOutputs--> Handover (bounded by credits) --> Scheduler
    ModelLoader --ModelReady / ModelLost--> Handover (in order with the steps) --> Scheduler
    Scheduler --StepOutputs (sync call)--> PromptCachePolicy: miss reasons, evictions
    Scheduler --StepOutputs (4)--> Detokenizer --Outbox (merging)--> Session
    Runtime --open/close (sync)--> PromptCachePolicy: the lookup's predicted outlook

It lives above the actors because it wires them (``runtime/`` is the kernel
and knows neither actors nor the HTTP edge). ``Runtime.run`` opens the nursery
and starts the Scheduler, the Detokenizer and the ModelLoader with
``nursery.start``; cancelling it stops them all, the engine included (it sees
the cancellation at its next step or idle wait); until then the nursery stays
open, also after the actors have ended by themselves. An actor that crashes marks
the runtime dead, so ``/health`` answers 503. The prompt-cache policy has no
task: the Scheduler and the Runtime call it.

The Runtime reaches each actor only through its port (``SchedulerPort``,
``DetokenizerPort``, ``ModelLoaderPort``), never its core. It is the
``SessionPort`` each ``Session`` talks to, and reads ``/health`` and
``/metrics`` figures from the actors' frozen snapshots (``metrics``: its
``actors.metrics.ServerMetrics``). ``model_policy`` says which models a
request may name (``resolve``). With ``--embedding-model``, the Embeddings
actor (``actors.embeddings``, ``embeddings``) runs beside them, on its own
thread: ``/health`` is ready once both models are.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence

import trio

from actors.detokenizer import Detokenizer, DetokenizerCore
from actors.embeddings import Embeddings, EmbeddingState
from actors.metrics import RuntimeFigures, ServerMetrics
from actors.model_loader import (
    STEPS_AHEAD,
    EngineProcessSpec,
    ModelLoader,
    ModelLoaderCore,
    ModelState,
)
from actors.prompt_cache import PromptCachePolicy
from actors.request_timing import RequestTiming
from actors.scheduler import Scheduler, SchedulerCore
from actors.session import Arrivals, Session
from runtime.config import ServerConfig
from runtime.distributed import launched_rank
from runtime.engine.core import EngineCore
from runtime.errors import NotFound, Unavailable, shutting_down
from runtime.handover import Handover
from runtime.lifecycle import EngineReady
from runtime.loaded_model import LoadedModel
from runtime.messages import AbortReason, PromptCacheOutlook, StepOutputs, Submit, TextSpec
from runtime.models import (
    DEFAULT_ALIASES,
    EngineCoreFactory,
    ModelKey,
    ModelPolicy,
    default_key,
    names_served,
    resolve_key,
    resolve_model,
)
from runtime.outbox import Outbox

log = logging.getLogger(__name__)

DRAIN_MARGIN = 1.0  # seconds between ending open requests and the HTTP server cutting them


def _engine_process_spec(config: ServerConfig) -> EngineProcessSpec:
    """Engines in child processes, logging as this process does."""
    handlers = logging.getLogger().handlers
    formatter = handlers[0].formatter if handlers else None
    return EngineProcessSpec(
        load_tokenizer=functools.partial(_load_tokenizer, config),
        log_level=config.log_level.upper(),
        log_format=getattr(formatter, "_fmt", None) or logging.BASIC_FORMAT,
        cpu_blas=config.cpu_blas,
    )


def _load_tokenizer(config: ServerConfig, ready: EngineReady):
    from runtime.engine.loading import load_tokenizer

    return load_tokenizer(config, ready.info.model_key, ready.eos_token_ids)


class Runtime:
    def __init__(self, config: ServerConfig, *, make_core: Callable[[], EngineCore] | None = None):
        """``make_core`` (tests) builds one fixed engine core; without it the real
        mlx-lm engine is built for whichever model a request asks for."""
        self.config = config
        self.model_id, self.model_path = resolve_model(config)
        # Distributed (started by mlx.launch, rank 0): one model for the launch's life.
        self.distributed = launched_rank() is not None
        self.switchable = make_core is None and not self.distributed
        if make_core is None:
            make_core_for = EngineCoreFactory(config)
        else:

            def make_core_for(key: ModelKey) -> EngineCore:
                return make_core()

        self.model_policy = ModelPolicy.from_config(config)
        self.metrics = ServerMetrics(self.figures)
        self.tokenize_limiter = trio.CapacityLimiter(config.tokenizer_threads)
        # Requests on their way to the engine: a Submit sent while others are says so
        # (``Submit.followed``), and a small batch waits for them (the admission window).
        self.arrivals = Arrivals()
        self._handover = Handover(STEPS_AHEAD)
        self._detok_send, self._detok_recv = trio.open_memory_channel[StepOutputs](4)
        self.prompt_cache = PromptCachePolicy(
            max_entries=config.prompt_cache_size,
            max_bytes=config.prompt_cache_bytes,
            min_reuse=config.prompt_cache_min_reuse,
        )
        self.scheduler = Scheduler(
            SchedulerCore(
                max_in_engine=config.decode_concurrency + config.prompt_concurrency,
                max_waiting=config.max_queued_requests,
                reply_reserve_tokens=config.kv_reply_reserve_tokens,
            ),
            to_detokenizer=self._detok_send,
            prompt_cache=self.prompt_cache,
            kv_budget_override=config.kv_cache_budget_bytes,
        )
        self.detokenizer = Detokenizer(DetokenizerCore(scheduler=self.scheduler))
        self._default_model = default_key(config, self.model_path)
        self.model_loader = ModelLoader(
            make_core_for,
            handover=self._handover,
            core=ModelLoaderCore(self._default_model),
            distributed=self.distributed,
            step_timeout=config.distributed_timeout,
            engine_process=(
                _engine_process_spec(config)
                if make_core is None and not self.distributed and config.engine_mode == "process"
                else None
            ),
            on_loaded=self.metrics.observe_load,
        )
        # The embedding model, when one is configured: its own thread, beside the engine.
        self.embeddings = (
            Embeddings(
                config.embedding_model,
                self.metrics,
                max_queued=config.max_queued_requests,
                batch_size=config.embedding_batch_size,
                batch_tokens=config.embedding_batch_tokens,
            )
            if config.embedding_model
            else None
        )
        self.dead: str | None = None
        self.accepting = True
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[Runtime] = trio.TASK_STATUS_IGNORED):
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.scheduler.run, self._handover.receive)
                await nursery.start(self.detokenizer.run, self._detok_recv)
                await nursery.start(self.model_loader.run)
                if self.embeddings is not None:
                    await nursery.start(self.embeddings.run)
                task_status.started(self)
                # Open until cancelled, even once the actors have ended (an engine
                # lost for good ends them): shutdown's drain still runs in it.
                await trio.sleep_forever()
        except Exception as exc:
            self.dead = f"runtime crashed: {type(exc).__name__}: {exc}"
            log.exception("the runtime crashed; /health now answers 503")

    # ------------------------------------------------------------- requests

    async def resolve(
        self, model: str | None, adapters: str | None = None, draft_model: str | None = None
    ) -> ModelKey:
        """The model a request names (404 if it is not allowed or not on this machine).

        Looking on disk and in the Hugging Face cache is blocking work: a worker thread;
        the served model under one of its names, with its own adapter and draft, needs
        no look (most requests: answered here, without the thread's hand-overs)."""
        if (
            adapters is None
            and draft_model in (None, *DEFAULT_ALIASES)
            and names_served(self.config, self.model_id, self.model_path, model)
        ):
            return self.default_model
        key = await trio.to_thread.run_sync(
            functools.partial(
                resolve_key,
                self.config,
                self.model_id,
                self.model_path,
                model=model,
                adapters=adapters,
                draft_model=draft_model,
                policy=self.model_policy,
            )
        )
        if not self.switchable and key != self.default_model:
            raise NotFound(f"model {model!r} is not served here", param="model")
        return key

    @property
    def default_model(self) -> ModelKey:
        return self._default_model

    @property
    def kv_budget(self) -> int | None:
        return self.scheduler.kv_budget

    def context_window(self, key: ModelKey | None = None) -> int | None:
        """The context window of ``key`` (default: the served model), once it has loaded."""
        return self.model_loader.context_window(key or self.default_model)

    @property
    def startup_failure(self) -> str | None:
        """Why the served model could not be loaded at start (it never was), else None."""
        status = self.model_loader.status()
        if status.state is ModelState.FAILED and not status.ever_loaded:
            return status.reason or "the model failed to load"
        if self.embeddings is not None and self.embeddings.state is EmbeddingState.FAILED:
            return f"embedding model {self.embeddings.reason}"
        return None

    def allocate_id(self) -> int:
        return self.scheduler.allocate_id()

    async def acquire(self, key: ModelKey) -> LoadedModel:
        """Wait until ``key`` is loaded and lease it; ``release`` when done."""
        if self.dead:
            raise Unavailable(self.dead, retry_after=30)
        if not self.accepting:
            raise shutting_down()
        return await self.model_loader.acquire(key)

    def release(self) -> None:
        self.model_loader.release()

    def drain(self, grace: float) -> None:
        """Shutdown has begun: refuse new requests now, and after ``grace`` seconds
        end every open request properly (a streamed request gets its last chunk,
        an error event and ``[DONE]``; a waiting one a 503), before the HTTP
        server cuts what is still running."""
        self.accepting = False
        if self._nursery is not None:
            self._nursery.start_soon(self._end_open_requests, grace)

    def drain_before(self, deadline: float) -> None:
        """The HTTP server will cut open requests at ``deadline`` (trio time): drain,
        so that they end properly ``DRAIN_MARGIN`` seconds before (once)."""
        if self.accepting:
            grace = max(0.0, deadline - trio.current_time() - DRAIN_MARGIN)
            log.info("the HTTP server is shutting down: open requests end in %.1f s", grace)
            self.drain(grace)

    async def _end_open_requests(self, grace: float) -> None:
        await trio.sleep(grace)
        self.detokenizer.abort_all(AbortReason.SHUTDOWN)

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
        """Register and submit (each of ``submit.request_ids`` with its outbox);
        returns the prompt cache's predicted outlook."""
        if not self.accepting:
            raise shutting_down()
        for request_id, outbox in zip(submit.request_ids, outboxes, strict=True):
            self.detokenizer.open(request_id, spec, outbox, handle.tokenizer)
        try:
            outlook = self.prompt_cache.open(
                submit.request_id,
                handle.info.model_key,
                submit.prompt,
                template_key=template_key,
                conversation_keys=conversation_keys,
                scope=submit.cache_scope,
            )
            self.scheduler.submit(submit)
        except BaseException:
            for request_id in submit.request_ids:
                self.close_request(request_id)
            raise
        return outlook

    def close_request(self, request_id: int) -> None:
        """Synchronous: called from cleanup, possibly while cancelled. A request
        still running is aborted (``CLOSED``: no terminal, nobody reads it)."""
        self.detokenizer.abort(request_id, AbortReason.CLOSED)
        self.prompt_cache.close(request_id)

    def abort_request(self, request_id: int, reason: AbortReason) -> None:
        """Stop a request early; the Detokenizer gives it the terminal ``reason``
        calls for and aborts it in the engine."""
        self.detokenizer.abort(request_id, reason)

    def record_request(self, timing: RequestTiming) -> None:
        self.metrics.observe_request(timing)

    def session(self, **kwargs) -> Session:
        return Session(self, **kwargs)

    # ---------------------------------------------------------------- health

    def prompt_cache_figures(self) -> dict:
        """The prompt-cache policy's figures: entries, bytes, hits, cached (reused) tokens,
        misses by reason, evictions and evicted bytes, limits (``/health``, ``/metrics``)."""
        return self.prompt_cache.figures()

    def figures(self) -> RuntimeFigures:
        """The state ``/metrics`` reads at each scrape."""
        scheduler = self.scheduler.figures()
        loader = self.model_loader.status()
        return RuntimeFigures(
            model_ready=loader.state is ModelState.READY and not self.dead,
            requests_in_flight=scheduler.in_flight,
            requests_running=scheduler.running,
            requests_waiting=scheduler.waiting,
            kv_reserved_bytes=scheduler.kv_reserved_bytes,
            kv_budget_bytes=scheduler.kv_budget_bytes or 0,
            engine_restarts=loader.restarts,
            preemptions=scheduler.preemptions,
            stats=scheduler.stats,
            prompt_cache=self.prompt_cache_figures(),
        )

    def health(self) -> tuple[int, dict]:
        loader = self.model_loader.status()
        scheduler = self.scheduler.figures()
        info = loader.info
        body = {
            "status": "ok",
            "model": self.model_id if loader.model == loader.default else loader.model.model,
            "model_state": loader.state.value,
            "active_sequences": scheduler.stats.active_sequences,
            "requests_in_flight": scheduler.in_flight,
            "waiting": scheduler.waiting,
            "engine_restarts": loader.restarts,
            "kv_cache": {
                "budget_bytes": scheduler.kv_budget_bytes,
                "reserved_bytes": scheduler.kv_reserved_bytes,
                "preemptions": scheduler.preemptions,
                "shared_bytes": scheduler.stats.shared_kv_bytes,
            },
            "prompt_cache": self.prompt_cache_figures(),
        }
        stats = scheduler.stats
        if self.config.prompt_cache_dir is not None:
            body["prompt_cache"]["disk"] = {
                "entries": stats.prompt_cache_disk_entries,
                "bytes": stats.prompt_cache_disk_bytes,
                "writes": stats.prompt_cache_disk_writes,
                "reads": stats.prompt_cache_disk_reads,
                "read_tokens": stats.prompt_cache_disk_read_tokens,
            }
        body["engine"] = {
            "mode": loader.engine_mode,
            "pid": (info.engine_pid or os.getpid()) if info is not None else None,
        }
        if info is not None:
            body["max_model_len"] = info.context_window
        if info is not None and info.ranks > 1:
            body["distributed"] = {"ranks": info.ranks, "parallel": info.parallel}
        embeddings_down = None
        if self.embeddings is not None:
            body["embeddings"] = self.embeddings.health()
            if self.embeddings.state is not EmbeddingState.READY:
                embeddings_down = f"the embedding model is {self.embeddings.state.value}"
        engine_down = self.dead or loader.state is not ModelState.READY
        if engine_down or not self.accepting or embeddings_down:
            body["status"] = "unavailable"
            body["reason"] = (
                self.dead or loader.reason or f"the model is {loader.state.value}"
                if engine_down
                else embeddings_down
            )
            if not self.accepting:
                body["reason"] = "shutting down"
            return 503, body
        return 200, body
