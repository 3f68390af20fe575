"""Serving one model across several processes with ``mx.distributed``.

Owns the distributed side of the engine: telling from the environment that
``mlx.launch`` started this process (``MLX_RANK``), initialising the group on
the engine thread (MLX streams belong to the thread that made them, so the
group, the sharded load and every step run on that one thread), seeding the
random state identically on every rank, and ``CommandExchange``: once per
engine step, rank 0 shares the engine commands it drained from its inbox
(``Submit`` / ``Abort`` / ``EvictCache`` / ``Shutdown``, pickled) with every other rank through
two ``all_sum`` collectives, so all ranks apply the same commands in the same
order and run identical batch steps.

Rank 0 runs Hypercorn and the actors; the other ranks run
``runtime.engine.loop.run_follower``: the engine loop alone, commands in,
outputs dropped. The engine loops reach ``CommandExchange`` through
``runtime.engine.commands.SharedCommands``.

Imports nothing of this project: ``runtime.config`` reads its constants.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

log = logging.getLogger(__name__)

BACKENDS = ("any", "ring", "jaccl", "jaccl-ring", "nccl", "mpi")
PIPELINE_ON_GPU = (
    "pipeline parallel passes activations with send/recv, which MLX's NCCL backend does "
    "not implement (mlx 0.32: '[nccl] Send not supported in NCCL backend'): on GPUs use "
    "tensor parallel (drop --pipeline)"
)
HEARTBEAT_SECONDS = 1.0  # rank 0 shares an empty step this often while idle


def launched_rank() -> int | None:
    """This process's rank if a distributed launcher started it, else ``None``."""
    value = os.environ.get("MLX_RANK")
    if value is None or not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        return None


def is_follower() -> bool:
    rank = launched_rank()
    return rank is not None and rank > 0


class ParentWatch:
    """Whether the process that started this one (``mlx.launch``) is gone.

    Made when the process starts: its parent then is the launcher. A parent
    that dies leaves its children re-parented (to init or a subreaper), which
    ``gone`` sees; ``mx.distributed`` does not notice a dead launcher, so its
    ranks would otherwise serve on. A process started by init itself has no
    launcher to watch."""

    def __init__(self, pid: int | None = None):
        self.pid = os.getppid() if pid is None else pid

    def gone(self) -> bool:
        return self.pid > 1 and os.getppid() != self.pid


def leave_now(status: int) -> None:
    """End this process at once (logs flushed): a follower rank has nothing to clean up."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # the launcher held the other end of the pipe
    os._exit(status)


class LeaderWatch:
    """A follower rank's watchdog thread: it leaves (status 1) when its launcher is
    gone, or when rank 0 has sent nothing for ``timeout`` seconds (rank 0 shares
    a step or a heartbeat every ``HEARTBEAT_SECONDS``; ``tick`` records each).

    The follower's main thread may be blocked in a collective for ever (rank 0
    frozen, or gone without closing its sockets), so the watch runs beside it.
    Silence counts from the first ``tick`` (after the model has loaded)."""

    def __init__(
        self,
        parent: ParentWatch | None,
        timeout: float,
        *,
        interval: float = 0.5,
        leave: Callable[[int], None] = leave_now,
    ):
        self.parent = parent
        self.timeout = timeout
        self.interval = interval
        self._leave = leave
        self._last: float | None = None

    def tick(self) -> None:
        self._last = time.monotonic()

    def reason(self) -> str | None:
        """Why this rank should leave now, or None."""
        if self.parent is not None and self.parent.gone():
            return f"the launcher (pid {self.parent.pid}) is gone"
        if self._last is not None:
            silent = time.monotonic() - self._last
            if silent > self.timeout:
                return f"rank 0 has sent no step or heartbeat for {silent:.0f} s"
        return None

    def start(self) -> None:
        threading.Thread(target=self._run, name="leader-watch", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            reason = self.reason()
            if reason is not None:
                log.error("%s; this rank leaves", reason)
                self._leave(1)
                return


@attrs.define
class GroupInfo:
    """The distributed group as the engine sees it."""

    group: Any
    rank: int
    size: int
    pipeline: bool

    @property
    def mode(self) -> str:
        return "pipeline" if self.pipeline else "tensor"


def init_group(backend: str, *, pipeline: bool) -> GroupInfo | None:
    """Initialise the group on the calling thread (the engine thread).

    Returns ``None`` when this process was not started by a distributed
    launcher or the group has one rank.
    """
    if launched_rank() is None:
        return None
    import mlx.core as mx

    if pipeline and mx.default_device().type == mx.DeviceType.gpu:
        raise RuntimeError(PIPELINE_ON_GPU)

    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() < 2:
        return None
    log.info(
        "distributed group: rank %d of %d (%s parallel, backend %s)",
        group.rank(),
        group.size(),
        "pipeline" if pipeline else "tensor",
        backend,
    )
    return GroupInfo(group=group, rank=group.rank(), size=group.size(), pipeline=pipeline)


def seed_all_ranks(info: GroupInfo) -> None:
    """One all_sum of the random state: every rank then draws the same numbers."""
    import mlx.core as mx

    total = mx.distributed.all_sum(mx.random.state[0], group=info.group)
    mx.random.seed(int(total.view(mx.uint64).item()))


class CommandExchange:
    """Rank 0's engine commands, shared with every rank once per step.

    ``share(commands)`` is a collective: every rank calls it once per step, in
    the same order; rank 0 passes what it drained, the others pass ``None`` and
    get rank 0's list back. An empty step costs one scalar ``all_sum``.
    """

    def __init__(self, info: GroupInfo, stream: Any = None):
        self.info = info
        self._stream = stream

    @property
    def leader(self) -> bool:
        return self.info.rank == 0

    def share(self, commands: list | None) -> list:
        import mlx.core as mx
        import numpy as np

        group = self.info.group
        payload = pickle.dumps(commands) if self.leader and commands else b""
        kwargs = {"group": group}
        if self._stream is not None:
            kwargs["stream"] = self._stream
        size = mx.distributed.all_sum(mx.array(len(payload), dtype=mx.int32), **kwargs)
        n = int(size.item())
        if n == 0:
            return []
        if self.leader:
            data = mx.array(np.frombuffer(payload, dtype=np.uint8))
        else:
            data = mx.zeros((n,), dtype=mx.uint8)
        data = mx.distributed.all_sum(data, **kwargs)
        mx.eval(data)
        if self.leader:
            return list(commands)
        return pickle.loads(np.array(data).tobytes())  # noqa: S301 - a peer rank we launched
