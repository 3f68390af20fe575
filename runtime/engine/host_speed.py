"""The host core's speed, for benchmarks: a fixed pure-Python loop, timed.

At batch 1 (and on a busy host at any batch) an engine step is bound by the
Python that builds its graph, so it runs as fast as the core it lands on. On a
shared machine the cores' speed changes (the H200 device's vCPUs: the same
loop takes about 16 or 30 us, in stretches of seconds), and a comparison of two
engines measures that unless it knows it. ``cpu_probe_us`` times the loop once;
``ProbeLog`` keeps one probe per engine step in an engine process and writes
``epoch_seconds probe_us`` lines (``PROBE_ENV`` names the file; unset, the
engine does nothing of this). ``ProbeLog.trace_steps`` also times the engine
core's steps and commands into ``PATH-steps.PID``: ``S began ended tokens
finished prompts started next_ms progress cpu_ms active_mb cache_mb`` per step
(``prompts``: prompts it prefilled; ``next_ms``: of the step, the time inside the
batch generator's ``next``; ``progress``: ``id:done/total`` of each prompt it
prefilled, comma separated, or ``-``; ``cpu_ms``: the engine thread's CPU time in
the step, which leaves out the waits that block (MLX's waits for the device do; the
CUDA driver's own, such as a launch into a full queue, spin and count unless its
contexts are set to block); ``active_mb``, ``cache_mb``: MLX's
memory in use and its cache of freed buffers after the step) and
``C epoch kind request_id`` per command. With ``SLOW_STEP_ENV`` set to a number of
milliseconds too, every step runs under ``cProfile`` and a step that took longer
leaves its profile in ``PATH-slow-EPOCH.PID`` (its ``S`` line's start). Emits
nothing else.
"""

from __future__ import annotations

import os
import time

PROBE_ENV = "MLX_TRIO_ENGINE_PROBE"  # benchmarks: a path; the engine process appends to PATH.PID
SLOW_STEP_ENV = "MLX_TRIO_ENGINE_SLOW_STEP_MS"  # benchmarks: profile steps slower than this
PROBE_ITERATIONS = 400  # about 16-30 us of pure Python on a server core
FLUSH_SECONDS = 0.5  # the engine ticks while idle too (every 50 ms), so the tail goes out


def probe_path(suffix: str = "") -> str | None:
    """This process's benchmark log ``PREFIX<suffix>.PID`` (None: ``PROBE_ENV`` unset)."""
    prefix = os.environ.get(PROBE_ENV)
    return f"{prefix}{suffix}.{os.getpid()}" if prefix else None


def _memory_mb() -> str:
    """``active cache``: MLX's memory in use and its cache of freed buffers, in MB."""
    try:
        import mlx.core as mx

        return f"{mx.get_active_memory() / 1e6:.0f} {mx.get_cache_memory() / 1e6:.0f}"
    except Exception:  # an MLX without these counters
        return "- -"


def cpu_probe_us(iterations: int = PROBE_ITERATIONS) -> float:
    """Microseconds a fixed pure-Python loop takes now on this thread's core."""
    began = time.perf_counter_ns()
    x = 0
    for i in range(iterations):
        x += i * i
    return (time.perf_counter_ns() - began) / 1000


class ProbeLog:
    """One probe per call, appended to ``path`` every ``FLUSH_SECONDS`` (synchronous)."""

    def __init__(self, path: str, steps_path: str | None = None):
        self.path = path
        self.steps_path = steps_path
        self._lines: list[str] = []
        self._steps: list[str] = []
        self._flushed = time.monotonic()

    @classmethod
    def from_environment(cls) -> ProbeLog | None:
        path = probe_path()
        return cls(path, probe_path("-steps")) if path else None

    def trace_steps(self, core):
        """Wrap ``core``'s ``step`` and ``handle_command`` to log each (benchmarks only)."""
        step, handle_command = core.step, core.handle_command
        inside = [0.0]  # seconds in the generator's next() during this step

        def timed(next_):
            def timed_next():
                began = time.perf_counter()
                try:
                    return next_()
                finally:
                    inside[0] += time.perf_counter() - began

            timed_next.timed = True
            return timed_next

        slow_ms = float(os.environ.get(SLOW_STEP_ENV) or 0)

        def traced_step():
            batch = core._batch  # a new one after a failed step: wrap that too
            if not getattr(batch.next, "timed", False):
                batch.next = timed(batch.next)
            inside[0] = 0.0
            began, cpu = time.time(), time.thread_time()
            if slow_ms:
                outputs = self._profiled(step, began, slow_ms)
            else:
                outputs = step()
            finished = sum(1 for e in outputs.tokens if e.finish_reason is not None)
            prompts = len({p.request_id for p in outputs.progress})
            progress = ",".join(f"{p.request_id}:{p.done}/{p.total}" for p in outputs.progress)
            cpu_ms = 1000 * (time.thread_time() - cpu)
            self._steps.append(
                f"S {began:.4f} {time.time():.4f} {len(outputs.tokens)} {finished} "
                f"{prompts} {len(outputs.started)} {1000 * inside[0]:.2f} {progress or '-'} "
                f"{cpu_ms:.2f} {_memory_mb()}\n"
            )
            return outputs

        def traced_command(command):
            request_id = getattr(command, "request_id", "-")
            self._steps.append(f"C {time.time():.4f} {type(command).__name__} {request_id}\n")
            return handle_command(command)

        core.step, core.handle_command = traced_step, traced_command
        return core

    def _profiled(self, step, began: float, slow_ms: float):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
        try:
            return step()
        finally:
            profile.disable()
            if 1000 * (time.time() - began) > slow_ms:
                profile.dump_stats(probe_path(f"-slow-{began:.4f}"))

    def tick(self) -> None:
        self._lines.append(f"{time.time():.3f} {cpu_probe_us():.1f}\n")
        if time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        self._flushed = time.monotonic()
        for path, lines in ((self.path, self._lines), (self.steps_path, self._steps)):
            if lines and path:
                with open(path, "a") as f:
                    f.writelines(lines)
                lines.clear()
