"""The benchmarks' host-speed probe (runtime.engine.host_speed): the loop, and the engine's log."""

from __future__ import annotations

import time

from runtime.engine.host_speed import PROBE_ENV, ProbeLog, cpu_probe_us


def test_the_probe_times_a_loop_that_grows_with_its_length():
    short = min(cpu_probe_us(100) for _ in range(20))
    long = min(cpu_probe_us(10_000) for _ in range(20))
    assert 0 < short < long


def test_the_log_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(PROBE_ENV, raising=False)
    assert ProbeLog.from_environment() is None


def test_the_log_writes_one_timed_probe_per_tick(monkeypatch, tmp_path):
    monkeypatch.setenv(PROBE_ENV, str(tmp_path / "probe"))
    log = ProbeLog.from_environment()
    assert log is not None and log.path.startswith(str(tmp_path / "probe."))
    began = time.time()
    for _ in range(5):
        log.tick()
    log.flush()
    log.flush()  # nothing twice
    lines = [line.split() for line in open(log.path).read().splitlines()]
    assert len(lines) == 5
    assert all(began - 1 <= float(at) <= time.time() + 1 and float(us) > 0 for at, us in lines)
