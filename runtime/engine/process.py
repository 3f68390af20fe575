"""The engine in its own process: one child process per loaded model.

Why: every Python thread of one process shares one GIL, so the engine
thread's per-step Python (mlx-lm's ``BatchGenerator``, graph building) and the
event loop's per-token HTTP work take turns. In a child process the engine
keeps a core of its own, and a crash in native code (a segfault in MLX) takes
down the child, not the server: the ModelLoader restarts it like a crashed
engine thread.

The child runs the very same ``run_engine_loop`` as the in-process engine
thread, on its main thread (which owns MLX for the child's lifetime). Over one socket
pair (``multiprocessing.connection`` framing and pickling):

* parent -> child: one ``EngineProcessStart`` (what to build, how to log),
  then ``Submit`` / ``Abort`` / ``EvictCache`` / ``Shutdown``, put into a
  ``ProcessInbox``: small ones written to the socket at once when it has
  room, the rest by a writer thread, in order (so ``inbox.put`` never blocks
  the event loop, even on a stalled child); the engine loop reads them from
  the socket between steps. EOF (the parent died) means ``Shutdown``.
* child -> parent: ``EngineReady`` once loaded, one ``StepOutputs`` per step,
  ``EngineCrashed`` before a crash's failures, and ``EngineExited`` last. The
  pipe is bounded (the OS buffer), and the parent's proxy thread takes a step
  only when it holds one of the ModelLoader's ``STEPS_AHEAD`` credits, so the
  child runs at most a few steps ahead of the Scheduler.

``run_engine_proxy`` is the parent's side; it runs in one ``trio.to_thread``
thread for the child's lifetime (the ModelLoader's engine thread slot), loads
the tokenizer for the trio side (detokenizing, chat templates), and turns the
child's messages into the same calls the in-process engine thread makes.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import attrs

from runtime.cpu_blas import child_environment
from runtime.engine.host_speed import ProbeLog
from runtime.engine.loop import run_engine_loop, settle_heap
from runtime.lifecycle import EngineCrashed, EngineExited, EngineProcessStart, EngineReady
from runtime.loaded_model import LoadedModel
from runtime.messages import Shutdown, StepOutputs
from runtime.vision import load_vision_processor

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often the proxy thread looks for cancellation while idle
SHUTDOWN_SECONDS = 10.0  # how long a cancelled proxy waits for the child to leave
# Benchmarks: set to a path prefix and each engine process writes cProfile
# statistics to PREFIX.PID when it exits.
PROFILE_ENV = "MLX_TRIO_ENGINE_PROFILE"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # where ``runtime`` can be imported from


class EngineProcessError(Exception):
    """The engine process crashed or died; the message says how."""


# ------------------------------------------------------------------ the child


def engine_process_main(conn) -> None:
    """The child's body: the start-up message, then the engine loop on this (main) thread."""
    # The parent decides when to stop: Ctrl-C in a terminal reaches the whole
    # process group, and a SIGTERM to the group must let the parent drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        start = conn.recv()
    except (EOFError, OSError):
        os._exit(1)
    if not isinstance(start, EngineProcessStart):
        os._exit(1)
    make_core = start.make_core
    logging.basicConfig(level=start.log_level, format=start.log_format)
    # The engine loop reads its commands from the socket itself, between steps:
    # no reader thread, so an Abort waits for no thread switch (with one, it
    # waited up to the GIL's switch interval, several steps of a small model).
    inbox = ConnectionInbox(conn)

    def ready(core) -> None:
        settle_heap()  # before the first request: the loaded model out of the GC's way
        conn.send(engine_ready(core.handle))

    def crashed(reason: str) -> None:
        conn.send(EngineCrashed(reason=reason))

    error = None
    profile_path = os.environ.get(PROFILE_ENV)
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    probes = ProbeLog.from_environment()  # benchmarks only (runtime.engine.host_speed)
    try:
        run_engine_loop(
            make_core if probes is None else lambda: probes.trace_steps(make_core()),
            inbox,
            conn.send,
            lambda: None,
            on_ready=ready,
            on_crash=crashed,
            on_tick=probes.tick if probes is not None else lambda: None,
        )
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.error("the engine process failed: %s", error)
    if probes is not None:
        probes.flush()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile_path}.{os.getpid()}")
    try:
        conn.send(EngineExited(error=error))
        conn.close()
    except OSError:
        pass
    # No interpreter teardown: MLX's and the tokenizer's threads need no goodbye.
    logging.shutdown()
    os._exit(1 if error else 0)


class ConnectionInbox:
    """The engine loop's inbox in an engine process: commands straight from the socket.

    ``get`` / ``get_nowait`` as ``queue.SimpleQueue`` has them (``run_engine_loop``
    drains with them). End-of-file, the parent gone, reads as ``Shutdown``.
    """

    def __init__(self, conn):
        self._conn = conn
        self._closed = False

    def get(self, timeout: float | None = None):
        if self._closed:  # the one Shutdown has been given
            if timeout:
                time.sleep(timeout)
            raise queue.Empty
        try:
            if not self._conn.poll(timeout):
                raise queue.Empty
            return self._conn.recv()
        except (EOFError, OSError):
            self._closed = True
            return Shutdown()

    def get_nowait(self):
        return self.get(0)


def engine_ready(handle: LoadedModel) -> EngineReady:
    """What the parent needs of a loaded model (the model itself stays here)."""
    return EngineReady(
        info=attrs.evolve(handle.info, engine_pid=os.getpid()),
        eos_token_ids=tuple(sorted(handle.tokenizer.eos_token_ids)),
    )


# ----------------------------------------------------------------- the parent


def run_engine_proxy(
    make_core: Callable[[], Any],
    inbox: queue.SimpleQueue,
    load_tokenizer: Callable[[EngineReady], Any],
    *,
    emit: Callable[[StepOutputs], None],
    on_ready: Callable[[LoadedModel, ProcessInbox], None],
    on_crash: Callable[[str], None],
    check_cancelled: Callable[[], None],
    log_level: str = "INFO",
    log_format: str = logging.BASIC_FORMAT,
    cpu_blas: str = "openblas",
) -> None:
    """Start the engine process and relay its messages until it exits.

    Runs on a thread of its own (blocking I/O). Returns when the child exits
    after a ``Shutdown``; raises ``EngineProcessError`` when it crashed or
    died, and the cancellation ``check_cancelled`` raises (after stopping the
    child, waiting at most ``SHUTDOWN_SECONDS``).
    """
    process, here = _start_child(make_core, log_level, log_format, cpu_blas)
    commands = ProcessInbox(here, inbox)
    writer = threading.Thread(
        target=_forward_commands,
        args=(inbox, here, commands),
        name="engine-commands",
        daemon=True,
    )
    writer.start()
    exited: EngineExited | None = None
    try:
        exited = _relay(
            here,
            load_tokenizer,
            emit,
            lambda handle: on_ready(handle, commands),
            on_crash,
            check_cancelled,
        )
    except BaseException:
        # Cancelled (or the trio side failed): ask the child to stop, bounded.
        commands.put(Shutdown())
        _drain_until_exit(here, time.monotonic() + SHUTDOWN_SECONDS)
        raise
    finally:
        inbox.put(None)  # stops the writer
        try:
            process.wait(SHUTDOWN_SECONDS if exited is not None else 1.0)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit; killing it")
            process.kill()
            process.wait()
        here.close()
    if exited is None:
        raise EngineProcessError(f"the engine process died, {_describe_exit(process.returncode)}")
    if exited.error is not None:
        raise EngineProcessError(exited.error)


def _start_child(make_core, log_level: str, log_format: str, cpu_blas: str):
    """``python -m runtime.engine.process FD``, talking over one end of a socket pair.

    A plain subprocess rather than ``multiprocessing.Process``: a server run
    by ``hypercorn`` lives in a daemonic worker process, which
    ``multiprocessing`` does not let have children. Its environment preloads
    OpenBLAS for MLX's CPU products where ``cpu_blas`` asks for it
    (``runtime.cpu_blas``).
    """
    here_sock, there_sock = socket.socketpair()
    here = Connection(here_sock.detach())
    there_fd = there_sock.detach()
    env = child_environment(cpu_blas, os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "runtime.engine.process", str(there_fd)],
            pass_fds=(there_fd,),
            env=env,
            close_fds=True,
        )
    finally:
        os.close(there_fd)
    here.send(EngineProcessStart(make_core=make_core, log_level=log_level, log_format=log_format))
    return process, here


def _relay(conn, load_tokenizer, emit, on_ready, on_crash, check_cancelled) -> EngineExited | None:
    """Relay the child's messages; the ``EngineExited`` it ended with, or None if it died."""
    while True:
        while not conn.poll(POLL_SECONDS):
            check_cancelled()
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return None
        if isinstance(message, StepOutputs):
            emit(message)
        elif isinstance(message, EngineReady):
            tokenizer = load_tokenizer(message)
            log.info("engine process %d serves %s", message.info.engine_pid, message.info.model_key)
            on_ready(handle_from_ready(message, tokenizer))
        elif isinstance(message, EngineCrashed):
            on_crash(message.reason)
        elif isinstance(message, EngineExited):
            return message
        else:
            log.warning("unexpected message from the engine process: %r", message)


def handle_from_ready(ready: EngineReady, tokenizer) -> LoadedModel:
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        info=ready.info,
        # This side makes a request's image tensors, as it makes its tokens.
        processor=(load_vision_processor(ready.info.model_key, ready.info.vision_family)
                   if ready.info.vision_family else None),
    )


class ProcessInbox:
    """The engine inbox the trio side holds when the engine is a process.

    ``put`` never blocks: a small command (an ``Abort``, a ``Shutdown``, a short
    ``Submit``) goes straight into the socket when no command is waiting for
    the writer thread and the socket has room; anything else is queued for the
    writer thread, in order. Straight, an ``Abort`` reaches the engine without
    waiting for the writer thread to get the GIL from a busy event loop (up to
    5 ms: several steps of a small model).
    """

    DIRECT_BYTES = 16384  # well under the socket's free room whenever it polls writable

    def __init__(self, conn, queued: queue.SimpleQueue):
        self._conn = conn
        self._queued = queued  # pickled commands for the writer thread, FIFO
        self.lock = threading.Lock()  # held by whoever writes to the socket
        self._count_lock = threading.Lock()
        self._pending = 0  # commands handed to the writer thread and not yet written

    def put(self, command) -> None:
        data = bytes(ForkingPickler.dumps(command))
        if len(data) <= self.DIRECT_BYTES and self._send_direct(data):
            return
        with self._count_lock:
            self._pending += 1
        self._queued.put(data)

    def _send_direct(self, data: bytes) -> bool:
        if not self.lock.acquire(blocking=False):
            return False  # the writer thread is writing
        try:
            with self._count_lock:
                if self._pending:
                    return False  # earlier commands first
            if not _writable(self._conn):
                return False
            self._conn.send_bytes(data)
        except OSError:
            pass  # the child is gone; the relay reports it
        finally:
            self.lock.release()
        return True

    def empty(self) -> bool:
        """Whether every command put so far has been written to the socket."""
        with self._count_lock:
            return self._pending == 0

    def written(self) -> None:
        """The writer thread wrote one queued command."""
        with self._count_lock:
            self._pending -= 1


def _writable(conn) -> bool:
    # poll, not select: a busy server's descriptors can be numbered past 1024.
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLOUT)
    return any(events & select.POLLOUT for _, events in poller.poll(0))


def _forward_commands(queued: queue.SimpleQueue, conn, inbox: ProcessInbox) -> None:
    """Writer thread: the commands ``ProcessInbox`` queued, into the socket, until ``None``."""
    while True:
        data = queued.get()
        if data is None:
            return
        try:
            with inbox.lock:
                conn.send_bytes(data)
        except (OSError, ValueError):
            return  # the child is gone; the relay reports it
        inbox.written()


def _drain_until_exit(conn, deadline: float) -> None:
    """After a Shutdown: read (and drop) what the child still sends, until it exits."""
    while (left := deadline - time.monotonic()) > 0:
        try:
            if not conn.poll(left):
                return
            if isinstance(conn.recv(), EngineExited):
                return
        except (EOFError, OSError):
            return


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


if __name__ == "__main__":
    engine_process_main(Connection(int(sys.argv[1])))
