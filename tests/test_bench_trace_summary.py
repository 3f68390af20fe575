"""bench/trace_summary.py --slow: the steps that prefilled a trace's longest prompt,
against the decode-only steps before it, and each one over the factor listed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import trace_summary  # noqa: E402


def step(began: float, ms: float, rows: int, progress: str, cpu: float | None = None,
         memory: tuple[int, int] | None = None) -> str:
    line = f"S {began:.4f} {began + ms / 1000:.4f} {rows} 0 {0 if progress == '-' else 1} 0 {ms:.2f} {progress}"
    if cpu is not None:
        line += f" {cpu:.2f} {memory[0]} {memory[1]}"
    return line


def write_trace(tmp_path: Path, with_cpu: bool) -> Path:
    lines, t = [], 100.0

    def add(ms, rows, progress, cpu=None, memory=(900, 40)):
        nonlocal t
        lines.append(step(t, ms, rows, progress, cpu if with_cpu else None, memory))
        t += ms / 1000 + 0.001

    add(30, 4, "1:2000/4000", 29)  # a warm-up prompt nearly as long: not the window
    add(30, 4, "1:4000/4000", 29)
    for _ in range(9):  # decode-only steps of 16 rows: median 10 ms
        add(10, 16, "-", 9.5)
    add(50, 16, "7:256/4100", 12, (2000, 40))  # slow, mostly waiting
    add(20, 16, "7:320/4100", 19)
    add(45, 17, "7:384/4100", 44, (2100, 10))  # slow, building its graph
    add(25, 16, "7:4100/4100", 24)
    add(10, 16, "-", 9.5)  # after the window: not counted
    path = tmp_path / "probe-steps.1"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_window_is_the_last_longest_prompt_and_slow_steps_are_listed(tmp_path):
    text = trace_summary.slow_steps(str(write_trace(tmp_path, with_cpu=True)), 3.0)
    head, percentiles, over, _columns, *rows = text.splitlines()
    assert "prompt 7 (4100 tokens) over 4 steps" in head
    assert "9 steps, p50 10.0 ms (CPU 9.5)" in head
    assert "max 50.0 ms" in percentiles and "CPU p50" in percentiles
    assert over.strip().startswith("over 3x (30.0 ms): 2 steps")
    # step, ms, CPU, rows, prompt tokens prefilled, active and cached MB, the host probe
    # after it (no probe log here), progress
    assert [r.split() for r in rows] == [
        ["0", "50.0", "12.0", "16", "256", "2000", "40", "-", "7:256/4100"],
        ["2", "45.0", "44.0", "17", "64", "2100", "10", "-", "7:384/4100"],
    ]


def test_the_host_probe_after_each_slow_step_and_the_p99_without_stalls(tmp_path):
    """With the engine's host probes beside the trace, each slow step shows the probe
    taken right after it, and a line counts the window's steps whose probe read over
    twice the median, with the other steps' p99."""
    trace = write_trace(tmp_path, with_cpu=True)
    steps = [line.split() for line in trace.read_text().splitlines()]
    # A probe just after every step: 15 us, but 45 after the window's first step.
    probes = [f"{float(s[2]) + 0.0004:.3f} {45.0 if s[8] == '7:256/4100' else 15.0}"
              for s in steps]
    (tmp_path / "probe.1").write_text("\n".join(probes) + "\n")
    text = trace_summary.slow_steps(str(trace), 3.0)
    head, percentiles, over, stalls, _columns, *rows = text.splitlines()
    assert "p50 15.0 us; over 2x in 1 of its steps, the others p99 45.0 max 45.0 ms" in stalls
    assert [r.split()[7] for r in rows] == ["45.0", "15.0"]


def test_a_trace_without_cpu_times_still_lists_its_slow_steps(tmp_path):
    text = trace_summary.slow_steps(str(write_trace(tmp_path, with_cpu=False)), 3.0)
    rows = text.splitlines()[4:]
    assert [r.split()[:5] for r in rows] == [["0", "50.0", "-", "16", "256"],
                                             ["2", "45.0", "-", "17", "64"]]
    assert "CPU" not in text.splitlines()[1]
