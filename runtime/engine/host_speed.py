"""The host core's speed, for benchmarks: a fixed pure-Python loop, timed.

At batch 1 (and on a busy host at any batch) an engine step is bound by the
Python that builds its graph, so it runs as fast as the core it lands on. On a
shared machine the cores' speed changes (the H200 device's vCPUs: the same
loop takes about 16 or 30 us, in stretches of seconds), and a comparison of two
engines measures that unless it knows it. ``cpu_probe_us`` times the loop once;
``ProbeLog`` keeps one probe per engine step in an engine process and writes
``epoch_seconds probe_us`` lines (``PROBE_ENV`` names the file; unset, the
engine does nothing of this). Emits nothing else.
"""

from __future__ import annotations

import os
import time

PROBE_ENV = "MLX_TRIO_ENGINE_PROBE"  # benchmarks: a path; the engine process appends to PATH.PID
PROBE_ITERATIONS = 400  # about 16-30 us of pure Python on a server core
FLUSH_SECONDS = 0.5  # the engine ticks while idle too (every 50 ms), so the tail goes out


def cpu_probe_us(iterations: int = PROBE_ITERATIONS) -> float:
    """Microseconds a fixed pure-Python loop takes now on this thread's core."""
    began = time.perf_counter_ns()
    x = 0
    for i in range(iterations):
        x += i * i
    return (time.perf_counter_ns() - began) / 1000


class ProbeLog:
    """One probe per call, appended to ``path`` every ``FLUSH_SECONDS`` (synchronous)."""

    def __init__(self, path: str):
        self.path = path
        self._lines: list[str] = []
        self._flushed = time.monotonic()

    @classmethod
    def from_environment(cls) -> ProbeLog | None:
        prefix = os.environ.get(PROBE_ENV)
        return cls(f"{prefix}.{os.getpid()}") if prefix else None

    def tick(self) -> None:
        self._lines.append(f"{time.time():.3f} {cpu_probe_us():.1f}\n")
        if time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if self._lines:
            with open(self.path, "a") as f:
                f.writelines(self._lines)
            self._lines.clear()
