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


class _FakeCore:
    """What ``ProbeLog.trace_steps`` wraps: ``step()`` and ``handle_command``."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.commands = []
        self._batch = _FakeGenerator()

    def step(self):
        self._batch.next()
        return self.outputs

    def handle_command(self, command):
        self.commands.append(command)


class _FakeGenerator:
    def next(self):
        time.sleep(0.01)
        return [], []


def test_the_step_trace_logs_each_step_and_command(monkeypatch, tmp_path):
    from runtime.messages import (
        Abort,
        PromptProgress,
        SamplingParams,
        SequenceStarted,
        StepOutputs,
        Submit,
        TokenEvent,
    )

    monkeypatch.setenv(PROBE_ENV, str(tmp_path / "probe"))
    log = ProbeLog.from_environment()
    outputs = StepOutputs(
        started=(SequenceStarted(request_id=9, prompt_tokens=4, cached_tokens=0),),
        progress=(
            PromptProgress(request_id=9, done=2, total=4),
            PromptProgress(request_id=9, done=4, total=4),
            PromptProgress(request_id=8, done=4, total=4),
        ),
        tokens=(
            TokenEvent(request_id=1, token=5),
            TokenEvent(request_id=2, token=6, finish_reason="length"),
            TokenEvent(request_id=3, token=7),
        ),
    )
    core = log.trace_steps(_FakeCore(outputs))
    submit = Submit(
        request_id=7,
        prompt=(1, 2),
        segments=((1, 2),),
        segment_types=("user",),
        sampling=SamplingParams(),
        max_tokens=4,
    )
    began = time.time()
    core.handle_command(submit)
    core.handle_command(Abort(request_id=3))
    assert core.step() is outputs  # the wrapped core still answers
    assert core.commands[0] is submit and isinstance(core.commands[1], Abort)
    log.flush()
    lines = [line.split() for line in open(log.steps_path).read().splitlines()]
    assert [line[0] for line in lines] == ["C", "C", "S"]
    assert lines[0][2:] == ["Submit", "7"] and lines[1][2:] == ["Abort", "3"]
    (kind, start, end, tokens, finished, prompts, started, next_ms, progress, cpu_ms,
     active_mb, cache_mb) = lines[2]
    assert began - 1 <= float(start) <= float(end) <= time.time() + 1
    # The time inside the generator's next(): its 10 ms sleep, within the step.
    assert 10 <= float(next_ms) <= 1000 * (float(end) - float(start)) + 1
    assert (tokens, finished, prompts, started) == ("3", "1", "2", "1")
    assert progress.split(",") == [f"{p.request_id}:{p.done}/{p.total}" for p in outputs.progress]
    # The step slept: its thread's CPU time is a small part of its wall time.
    assert 0 <= float(cpu_ms) < 1000 * (float(end) - float(start))
    assert int(active_mb) >= 0 and int(cache_mb) >= 0


def test_steps_slower_than_the_bound_leave_their_profile(monkeypatch, tmp_path):
    import pstats

    from runtime.engine.host_speed import SLOW_STEP_ENV
    from runtime.messages import StepOutputs

    class _Sleeps(_FakeGenerator):
        def __init__(self):
            self.seconds = [0.0, 0.06, 0.0]

        def next(self):
            time.sleep(self.seconds.pop(0))
            return [], []

    monkeypatch.setenv(PROBE_ENV, str(tmp_path / "probe"))
    monkeypatch.setenv(SLOW_STEP_ENV, "40")
    core = _FakeCore(StepOutputs())
    core._batch = _Sleeps()
    traced = ProbeLog.from_environment().trace_steps(core)
    for _ in range(3):
        traced.step()
    profiles = sorted(tmp_path.glob("probe-slow-*"))
    assert len(profiles) == 1  # the 60 ms step only
    names = {name for _, _, name in pstats.Stats(str(profiles[0])).stats}
    assert "next" in names  # the generator's call, where its time went
