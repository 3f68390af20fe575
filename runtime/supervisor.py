"""The runtime: five actors under one nursery, wired with bounded channels.

::

    Session --submit/withdraw--> Scheduler --Submit/Abort (SimpleQueue)--> engine thread
                                     ^                                         |
                                     +------ StepOutputs (channel, 2) ---------+
    Scheduler --StepOutputs (4)--> Detokenizer --Outbox (merging)--> Session
    Scheduler --EngineStats (1)--> PromptCacheActor
    ModelLoader: runs the engine thread, reports ready / lost

``Runtime.run`` opens the nursery and starts every actor with
``nursery.start``; cancelling it stops them all, the engine thread included
(it sees the cancellation at its next step or idle wait). An actor that
crashes marks the runtime dead, so ``/health`` answers 503.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from actors.detokenizer import Detokenizer, DetokenizerCore, TextSpec
from actors.model_loader import (
    STEPS_AHEAD,
    EngineProcessSpec,
    EngineStep,
    ModelLoader,
    ModelLoaderCore,
    ModelState,
)
from actors.prompt_cache import PromptCacheActor
from actors.scheduler import Scheduler, SchedulerCore
from actors.session import Session
from runtime.config import ServerConfig
from runtime.distributed import launched_rank
from runtime.engine import EngineCore, ModelHandle
from runtime.errors import NotFound, Unavailable
from runtime.messages import EngineReady, EngineStats, Failed, StepOutputs, Submit
from runtime.models import ModelKey, default_key, resolve_key
from runtime.outbox import Outbox

log = logging.getLogger(__name__)

TINY_MODEL_ID = "mlx-trio-tiny-random"
DEMO_MODEL_ID = "mlx-trio-demo"


def demo_model_dir() -> Path:
    """The embedded demo model (``demo_model/mlx-trio-demo``, installed with the package)."""
    return Path(__file__).resolve().parents[1] / "demo_model" / DEMO_MODEL_ID


def default_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-trio-server" / TINY_MODEL_ID


def resolve_model(config: ServerConfig) -> tuple[str, str]:
    """(model id served, path or repo to load).

    With no model configured: the embedded demo model, or, if this install
    lacks its weights, a tiny random model built on first use.
    """
    if config.model:
        return config.model, config.model
    demo = demo_model_dir()
    if (demo / "model.safetensors").exists():
        return DEMO_MODEL_ID, str(demo)
    return TINY_MODEL_ID, str(default_model_dir())


@attrs.frozen
class RealEngineCore:
    """Builds the mlx-lm engine for a ``ModelKey``, on the thread that will step it.

    A plain object (not a closure) so that it can travel to an engine process.
    """

    config: ServerConfig

    def __call__(self, key: ModelKey) -> EngineCore:
        from runtime.mlx_backend import make_engine_core

        config = self.config
        served_id, default_path = resolve_model(config)
        if not config.model and key.model == default_path and served_id == TINY_MODEL_ID:
            from runtime.tiny_model import build_tiny_model

            log.warning(
                "no --model given and the demo model's weights are missing: serving a tiny "
                "model with RANDOM weights (%s); its answers are noise. Pass --model PATH "
                "for a real model.",
                key.model,
            )
            if not (Path(key.model) / "model.safetensors").exists():
                build_tiny_model(key.model)
        return make_engine_core(
            attrs.evolve(config, adapter_path=key.adapter, draft_model=key.draft), key.model
        )


def _engine_process_spec(config: ServerConfig) -> EngineProcessSpec:
    """Engines in child processes, logging as this process does."""
    handlers = logging.getLogger().handlers
    formatter = handlers[0].formatter if handlers else None
    return EngineProcessSpec(
        load_tokenizer=functools.partial(_load_tokenizer, config),
        log_level=config.log_level.upper(),
        log_format=getattr(formatter, "_fmt", None) or logging.BASIC_FORMAT,
    )


def _load_tokenizer(config: ServerConfig, ready: EngineReady):
    from runtime.mlx_backend import load_tokenizer

    return load_tokenizer(config, ready.model_key, ready.eos_token_ids)


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
            make_core_for = RealEngineCore(config)
        else:

            def make_core_for(key: ModelKey) -> EngineCore:
                return make_core()

        self.tokenize_limiter = trio.CapacityLimiter(config.tokenizer_threads)
        self._engine_out_send, self._engine_out_recv = trio.open_memory_channel[EngineStep](
            STEPS_AHEAD + 2
        )
        self._detok_send, self._detok_recv = trio.open_memory_channel[StepOutputs](4)
        self._stats_send, self._stats_recv = trio.open_memory_channel[EngineStats](1)
        self.scheduler = Scheduler(
            SchedulerCore(
                max_in_engine=config.decode_concurrency + config.prompt_concurrency,
                max_waiting=config.max_queued_requests,
            ),
            to_detokenizer=self._detok_send,
            to_prompt_cache=self._stats_send,
        )
        self.detokenizer = Detokenizer(core=None)
        self.prompt_cache = PromptCacheActor()
        self.model_loader = ModelLoader(
            make_core_for,
            outputs=self._engine_out_send,
            on_ready=self._engine_ready,
            on_lost=self._engine_lost,
            core=ModelLoaderCore(default_key(config, self.model_path)),
            distributed=self.distributed,
            step_timeout=config.distributed_timeout,
            engine_process=(
                _engine_process_spec(config)
                if make_core is None and not self.distributed and config.engine_mode == "process"
                else None
            ),
        )
        self.dead: str | None = None
        self.accepting = True
        self.responses: collections.Counter[tuple[str, int]] = collections.Counter()

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[Runtime] = trio.TASK_STATUS_IGNORED):
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.scheduler.run, self._engine_out_recv)
                await nursery.start(self.detokenizer.run, self._detok_recv)
                await nursery.start(self.prompt_cache.run, self._stats_recv)
                await nursery.start(self.model_loader.run)
                task_status.started(self)
        except Exception as exc:
            self.dead = f"runtime crashed: {type(exc).__name__}: {exc}"
            log.exception("the runtime crashed; /health now answers 503")

    def _engine_ready(self, handle: ModelHandle, inbox: queue.SimpleQueue) -> None:
        core = self.detokenizer.core
        if core is None or core.model_key != handle.model_key:
            # A new model (no request is open across a swap); after a restart of
            # the same model, the requests waiting in the Scheduler keep theirs.
            self.detokenizer.core = DetokenizerCore(
                handle.tokenizer, withdraw=self.scheduler.withdraw, model_key=handle.model_key
            )
        if self.config.kv_cache_budget_bytes is not None:
            self.scheduler.core.kv_budget = self.config.kv_cache_budget_bytes
        elif handle.kv_bytes_per_token and handle.kv_budget:
            self.scheduler.core.kv_budget = handle.kv_budget
        self.scheduler.attach_engine(inbox)

    def _engine_lost(self, reason: str, permanent: bool) -> None:
        lost = self.scheduler.detach_engine()
        if permanent:
            lost += list(self.scheduler.core.waiting)
            self.scheduler.core.waiting.clear()
        core = self.detokenizer.core
        if core is not None:
            for request_id in lost:
                core.fail(
                    request_id,
                    Failed(
                        message=f"the engine stopped: {reason}",
                        status=503,
                        type="service_unavailable",
                        retry_after=5,
                    ),
                )

    # ------------------------------------------------------------- requests

    def resolve(
        self, model: str | None, adapters: str | None = None, draft_model: str | None = None
    ) -> ModelKey:
        """The model a request names (404 if it is not on this machine)."""
        key = resolve_key(
            self.config,
            self.model_id,
            self.model_path,
            model=model,
            adapters=adapters,
            draft_model=draft_model,
        )
        if not self.switchable and key != self.model_loader.core.default:
            raise NotFound(f"model {model!r} is not served here", param="model")
        return key

    async def acquire(self, key: ModelKey) -> ModelHandle:
        """Wait until ``key`` is loaded and lease it; ``release`` when done."""
        if self.dead:
            raise Unavailable(self.dead, retry_after=30)
        if not self.accepting:
            raise Unavailable("the server is shutting down", retry_after=5)
        return await self.model_loader.acquire(key)

    def release(self) -> None:
        self.model_loader.release()

    def open_request(self, submit: Submit, spec: TextSpec, outbox: Outbox) -> None:
        core = self.detokenizer.core
        if core is None:
            raise Unavailable("the model is not loaded", retry_after=5)
        core.open(submit.request_id, spec, outbox)
        try:
            self.scheduler.submit(submit)
        except BaseException:
            core.close(submit.request_id)
            raise

    def close_request(self, request_id: int) -> None:
        """Synchronous: called from cleanup, possibly while cancelled."""
        core = self.detokenizer.core
        if core is not None:
            core.close(request_id)
        self.scheduler.withdraw(request_id)

    def expire_request(self, request_id: int) -> None:
        core = self.detokenizer.core
        if core is not None:
            core.expire(request_id)

    def session(self, **kwargs) -> Session:
        return Session(self, **kwargs)

    # ---------------------------------------------------------------- health

    def count_response(self, route: str, status: int) -> None:
        self.responses[(route, status)] += 1

    def metrics_text(self) -> str:
        """Prometheus text exposition of the runtime's state."""
        stats = self.scheduler.last_stats
        core = self.scheduler.core
        loader = self.model_loader.core
        gauges = {
            "mlx_trio_model_ready": int(loader.state is ModelState.READY and not self.dead),
            "mlx_trio_requests_in_flight": core.load,
            "mlx_trio_requests_waiting": len(core.waiting),
            "mlx_trio_active_sequences": stats.active_sequences,
            "mlx_trio_kv_reserved_bytes": core.kv_reserved,
            "mlx_trio_kv_budget_bytes": core.kv_budget or 0,
            "mlx_trio_prompt_cache_entries": stats.prompt_cache_entries,
            "mlx_trio_prompt_cache_bytes": stats.prompt_cache_bytes,
        }
        counters = {
            "mlx_trio_engine_steps_total": stats.steps,
            "mlx_trio_engine_prefill_steps_total": stats.prefill_steps,
            "mlx_trio_engine_busy_seconds_total": round(stats.busy_seconds, 6),
            "mlx_trio_engine_restarts_total": loader.restarts,
            "mlx_trio_prompt_cache_hits_total": stats.prompt_cache_hits,
            "mlx_trio_prompt_cache_cached_tokens_total": stats.prompt_cache_cached_tokens,
            "mlx_trio_engine_aborts_total": stats.aborts,
            "mlx_trio_engine_abort_wait_ms_total": round(stats.abort_wait_ms_total, 3),
        }
        gauges["mlx_trio_engine_abort_wait_ms_max"] = round(stats.abort_wait_ms_max, 3)
        gauges["mlx_trio_engine_abort_wait_steps_max"] = stats.abort_wait_steps_max
        lines = []
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        for name, value in counters.items():
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        lines.append("# TYPE mlx_trio_http_responses_total counter")
        for (route, status), n in sorted(self.responses.items()):
            lines.append(f'mlx_trio_http_responses_total{{route="{route}",status="{status}"}} {n}')
        return "\n".join(lines) + "\n"

    def health(self) -> tuple[int, dict]:
        loader = self.model_loader.core
        stats = self.scheduler.last_stats
        body = {
            "status": "ok",
            "model": self.model_id if loader.key == loader.default else loader.key.model,
            "model_state": loader.state.value,
            "active_sequences": stats.active_sequences,
            "requests_in_flight": self.scheduler.core.load,
            "waiting": len(self.scheduler.core.waiting),
            "engine_restarts": loader.restarts,
            "prompt_cache": self.prompt_cache.stats.as_dict(),
        }
        body["engine"] = {
            "mode": "process" if self.model_loader.engine_process is not None else "thread",
            "pid": (loader.handle.engine_pid or os.getpid()) if loader.handle is not None else None,
        }
        if loader.handle is not None and loader.handle.ranks > 1:
            body["distributed"] = {"ranks": loader.handle.ranks, "parallel": loader.handle.parallel}
        if self.dead or loader.state is not ModelState.READY or not self.accepting:
            body["status"] = "unavailable"
            body["reason"] = self.dead or loader.reason or f"the model is {loader.state.value}"
            if not self.accepting:
                body["reason"] = "shutting down"
            return 503, body
        return 200, body
