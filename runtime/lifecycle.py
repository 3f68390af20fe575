"""The messages of an engine's life: from its start to its loss.

Besides the request path (``runtime.messages``), three conversations carry
these frozen messages:

  * ModelLoader -> Scheduler (through ``runtime.handover``, in order with the
    steps): ``ModelReady`` (the engine's ``ModelInfo`` and its ``EngineInbox``)
    and ``ModelLost``.
  * parent -> engine process: one ``EngineProcessStart``, then the engine
    commands of ``runtime.messages``.
  * engine process -> its proxy thread, besides the ``StepOutputs``:
    ``EngineReady``, ``EngineCrashed``, ``EngineExited``.

``EngineInbox`` is the port the Scheduler puts engine commands into: a
``queue.SimpleQueue`` for an engine thread, a ``ProcessInbox`` for an engine
process; ``put`` never blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs

from runtime.messages import EngineCommand


class EngineInbox(Protocol):
    """Where engine commands go; ``put`` is synchronous and never blocks."""

    def put(self, command: EngineCommand, /) -> None: ...


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What a loaded model is, without the model: its identity and its figures."""

    model_key: str
    vocab_size: int
    batchable: bool = True
    kv_bytes_per_token: int = 0  # K and V, all layers: the admission estimate's unit
    kv_budget: int = 0  # bytes of KV cache the Scheduler may admit (0: no limit)
    prompt_cache_budget: int = 0  # the prompt cache's default byte limit (0: none)
    engine_pid: int | None = None  # the process that runs the engine (None: this one)
    ranks: int = 1  # distributed: how many processes share the model
    parallel: str | None = None  # distributed: "tensor" or "pipeline"
    context_window: int | None = None  # most tokens a sequence may hold (None: unknown)
    vision_family: str | None = None  # a vision-language model's model_type (runtime.vision)


@attrs.frozen(kw_only=True)
class ModelReady:
    """An engine is up: its commands go into ``inbox``."""

    info: ModelInfo
    inbox: EngineInbox = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class ModelLost:
    """The engine stopped taking requests; ``permanent``: none is coming back."""

    reason: str
    permanent: bool


# ------------------------------------------------------ to and from an engine process


@attrs.frozen(kw_only=True)
class EngineProcessStart:
    """The first thing an engine process receives: what to build, and how to log.

    ``make_core`` builds the ``EngineCore`` in the child (picklable:
    ``runtime.models.EngineCoreFactory`` bound to a ``ModelKey``)."""

    make_core: Callable[[], object]
    log_level: str
    log_format: str


@attrs.frozen(kw_only=True)
class EngineReady:
    """The engine process loaded its model: what the parent needs of it."""

    info: ModelInfo  # its engine_pid: the engine process
    eos_token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class EngineCrashed:
    """The engine loop is going down with an error (its failures follow)."""

    reason: str


@attrs.frozen(kw_only=True)
class EngineExited:
    """The engine process's last message: ``error`` is None after a ``Shutdown``."""

    error: str | None = None
