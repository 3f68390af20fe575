"""Summaries of per-step engine traces and of py-spy's raw profiles.

Reads the files ``engine_overhead.py --trace DIR`` writes (``S began ended tokens finished
prefill - next_ms`` per step, ``next_ms`` the time inside the generator's ``next()``;
``C epoch Submit request`` per arrival; a server's come from its engine process,
``runtime.engine.host_speed.ProbeLog.trace_steps``, with the number of prompts prefilled in
place of ``prefill``) and prints, per file: tokens/s over the traced span, the
time the engine spent stepping, the prefill steps (count, time, decoding rows they carried
on average) and the other steps, then the median step by decoding rows (``--by-rows``: with
``next_ms``, also its median time in ``next()``, the rest of the step, and the gap between the
step and the one before it: the engine loop's own work, a server's hand-over of outputs), or
each step (``--timeline N``: the first N, with the arrivals handled before each).

A server's trace also holds, per request, the API's record (``R id arrived submitted
first_output ended``, ``api.observability.RequestTrace``) and the load generator's (``L id
sent first end``), joined by the x-request-id the load generator sends. ``--requests N``
prints where each request's time to first token went, for the first N requests sent (by
send time) and as medians and maxima over all: sent to the API (connection, HTTP), the
API's own part until the Submit (templating, tokenising, the Scheduler), the engine until
the first output reached the API, and back to the client.

``--slow FACTOR`` reads a server's engine trace around its longest prompt (the last of
them: a benchmark's measured round; the window: the steps that prefilled it): the
median decode-only step before the window, the window's steps by percentile, and each
step that took more than FACTOR times that median, with its decoding rows, the prompt
tokens it prefilled, and, where the trace has them, the engine thread's CPU time in it
(a step that took much more than its CPU time waited: MLX's waits for the device
block; the CUDA driver's own spin unless told to block) and MLX's active and cached
memory after it. Where the engine's host probes lie beside the trace (``PREFIX.PID``
beside ``PREFIX-steps.PID``: a fixed Python loop timed after each step), each slow
step shows its probe, and a line counts the window's steps whose probe read over
``STALL_FACTOR`` times the median (the core slowed under the engine for the moment)
with the others' p99: what the window's own work gives without the host's stalls.

``--pyspy FILE`` instead sums a ``py-spy record -f raw`` profile: the share of samples
per innermost frame (self) and per frame anywhere on the stack (inclusive).

    python bench/trace_summary.py trace/*-c32-r1.txt --by-rows
    python bench/trace_summary.py trace/server-c32-r1.txt --timeline 60
    python bench/trace_summary.py trace/server-c32-r1.txt --requests 40
    python bench/trace_summary.py interleave-probe-steps.PID --slow 3
    python bench/trace_summary.py --pyspy pyspy-engine.txt
"""

from __future__ import annotations

import argparse
import bisect
import collections
import statistics
import sys


def read_steps(path: str) -> list[tuple[str, ...]]:
    return [tuple(line.split()) for line in open(path) if line.strip()]


def summary(path: str, by_rows: bool) -> str:
    lines = read_steps(path)
    steps = [s for s in lines if s[0] == "S"]
    if not steps:
        return f"{path}: no steps"
    tokens = sum(int(s[3]) for s in steps)
    wall = float(steps[-1][2]) - float(steps[0][1])
    prefill = [s for s in steps if s[5] != "0"]
    other = [s for s in steps if s[5] == "0"]

    def ms(group):
        return 1000 * sum(float(s[2]) - float(s[1]) for s in group)

    rows_in_prefill = sum(int(s[3]) for s in prefill) / max(len(prefill), 1)
    out = [
        f"{path}: {tokens / wall:.0f} tok/s over {1000 * wall:.0f} ms, stepping "
        f"{ms(steps):.0f} ms | prefill steps {len(prefill)}: {ms(prefill):.0f} ms, "
        f"{rows_in_prefill:.1f} decoding rows each | other steps {len(other)}: "
        f"{ms(other):.0f} ms"
    ]
    if by_rows:
        gaps = {id(b): 1000 * (float(b[1]) - float(a[2])) for a, b in zip(steps, steps[1:], strict=False)}
        by = collections.defaultdict(list)
        for s in other:
            by[int(s[3])].append(s)
        for rows in sorted(by):
            group = by[rows]
            durations = [1000 * (float(s[2]) - float(s[1])) for s in group]
            line = (
                f"    {rows:3d} rows: {len(durations):4d} steps, p50 "
                f"{statistics.median(durations):6.1f} ms, {sum(durations):7.0f} ms in all"
            )
            inside = [float(s[7]) for s in group if len(s) > 7 and s[7] != "-"]
            if inside:  # the step's time in the generator's next(), the rest, and the gap
                outside = [d - n for d, s in zip(durations, group, strict=True) if len(s) > 7
                           for n in [float(s[7])]]  # fmt: skip
                between = [gaps[id(s)] for s in group if id(s) in gaps]
                line += (
                    f" | next() p50 {statistics.median(inside):6.2f}, rest of the step "
                    f"{statistics.median(outside):5.2f}, gap before it "
                    f"{statistics.median(between) if between else float('nan'):5.2f} ms"
                )
            out.append(line)
    return "\n".join(out)


def timeline(path: str, limit: int) -> str:
    lines = [s for s in read_steps(path) if s[0] in "SC"]
    t0 = float(lines[0][1])
    out, arrivals, previous_end = [], 0, None
    for s in lines:
        if s[0] == "C":
            arrivals += s[2] == "Submit"
            continue
        if s[0] != "S":
            continue
        began, ended = float(s[1]), float(s[2])
        gap = 1000 * (began - previous_end) if previous_end is not None else 0.0
        out.append(
            f"{1000 * (began - t0):8.1f} ms  gap {gap:5.1f}  step {1000 * (ended - began):6.1f}  "
            f"arrivals {arrivals:3d}  tokens {int(s[3]):3d}  finished {int(s[4]):3d}  "
            f"prefill {s[5]}"
        )
        arrivals, previous_end = 0, ended
    return "\n".join(out[:limit])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def slow_steps(path: str, factor: float) -> str:
    """The steps that prefilled the trace's longest prompt, against the decode-only
    steps before them: percentiles, and each step over ``factor`` times their median."""
    steps = [s for s in read_steps(path) if s[0] == "S" and len(s) > 8]

    def prompts(step) -> dict[str, tuple[int, int]]:
        out = {}
        for part in step[8].split(","):
            if "/" in part:
                rid, _, counts = part.partition(":")
                done, _, total = counts.partition("/")
                out[rid] = (int(done), int(total))
        return out

    totals = {rid: total for s in steps for rid, (_, total) in prompts(s).items()}
    if not totals:
        return f"{path}: no prompt prefilled"
    # The last of the longest prompts (a benchmark's warm-up round comes first).
    longest = [rid for rid, total in totals.items() if total >= 0.9 * max(totals.values())][-1]
    window = [i for i, s in enumerate(steps) if longest in prompts(s)]
    first, last = window[0], window[-1]
    rows = statistics.median(int(steps[i][3]) for i in window)
    before = [s for s in steps[:first] if s[8] == "-" and int(s[3]) >= rows]
    if not before:
        return f"{path}: no decode-only step before prompt {longest}"

    def wall(step) -> float:
        return 1000 * (float(step[2]) - float(step[1]))

    def cpu(step) -> float | None:
        return float(step[9]) if len(step) > 9 and step[9] != "-" else None

    base = statistics.median(wall(s) for s in before)
    inside = steps[first:last + 1]
    walls = [wall(s) for s in inside]
    cpus = [c for s in inside for c in [cpu(s)] if c is not None]
    base_cpu = [c for s in before for c in [cpu(s)] if c is not None]
    out = [f"{path}: prompt {longest} ({totals[longest]} tokens) over {len(inside)} steps; "
           f"decode-only before it: {len(before)} steps, p50 {base:.1f} ms"
           + (f" (CPU {statistics.median(base_cpu):.1f})" if base_cpu else ""),
           f"  its steps: p50 {_percentile(walls, .5):.1f} p90 {_percentile(walls, .9):.1f} "
           f"p99 {_percentile(walls, .99):.1f} max {max(walls):.1f} ms"
           + (f"; CPU p50 {_percentile(cpus, .5):.1f} p90 {_percentile(cpus, .9):.1f}"
              if cpus else ""),
           f"  over {factor:g}x ({factor * base:.1f} ms): "
           f"{sum(w > factor * base for w in walls)} steps"]
    probes = step_probes(path, inside)
    if probes:
        median = statistics.median(p for p in probes if p is not None)
        stalled = [p is not None and p > STALL_FACTOR * median for p in probes]
        calm = [w for w, s in zip(walls, stalled, strict=True) if not s]
        out.append(f"  host probe after each step: p50 {median:.1f} us; over {STALL_FACTOR:g}x "
                   f"in {sum(stalled)} of its steps, the others p99 {_percentile(calm, .99):.1f} "
                   f"max {max(calm, default=0):.1f} ms")
    out.append(f"  {'step':>5} {'ms':>6} {'CPU':>6} {'rows':>4} {'prefilled':>9} "
               f"{'active MB':>9} {'cache MB':>9} {'probe us':>8}  progress")
    done_before = 0
    for i, step in enumerate(inside):
        done = prompts(step).get(longest, (done_before, 0))[0]
        prefilled, done_before = done - done_before, done
        if wall(step) <= factor * base:
            continue
        c = cpu(step)
        memory = step[10:12] if len(step) > 11 else ("-", "-")
        probe = probes[i] if probes and probes[i] is not None else None
        out.append(f"  {i:5d} {wall(step):6.1f} {'-' if c is None else f'{c:.1f}':>6} "
                   f"{step[3]:>4} {prefilled:9d} {memory[0]:>9} {memory[1]:>9} "
                   f"{'-' if probe is None else f'{probe:.1f}':>8}  {step[8]}")
    return "\n".join(out)


# A step whose host probe read more than this times the probes' median ran on a core
# slowed for the moment (a stall of the host, not of the step's own work).
STALL_FACTOR = 2.0


def step_probes(path: str, steps: list) -> list[float | None]:
    """The host probe the engine took right after each of ``steps`` (microseconds of a
    fixed Python loop: ``runtime.engine.host_speed``), read from the probe log beside
    the step trace (``PREFIX-steps.PID`` beside ``PREFIX.PID``); None where there is no
    log, or no probe within 20 ms of a step's end."""
    prefix, sep, pid = path.rpartition("-steps.")
    try:
        lines = open(f"{prefix}.{pid}").read().split() if sep else []
    except OSError:
        return []
    times, values = [float(t) for t in lines[0::2]], [float(v) for v in lines[1::2]]
    out: list[float | None] = []
    for step in steps:
        ended = float(step[2])
        j = bisect.bisect_left(times, ended - 0.001)  # probe times have three decimals
        out.append(values[j] if j < len(times) and times[j] - ended < 0.02 else None)
    return out if any(v is not None for v in out) else []


REQUEST_PHASES = ("to API", "API to Submit", "engine to 1st out", "back to client", "TTFT")


def _epoch(field: str) -> float | None:
    return None if field == "-" else float(field)


def requests(path: str, limit: int) -> str:
    """Per request: the phases of its time to first token (ms), from its R and L lines."""
    lines = read_steps(path)
    api = {s[1]: [_epoch(f) for f in s[2:6]] for s in lines if s[0] == "R"}
    client = {s[1]: [_epoch(f) for f in s[2:5]] for s in lines if s[0] == "L"}
    rows = []
    for rid, (sent, first, _end) in client.items():
        arrived, submitted, first_out, _ended = api.get(rid, [None] * 4)

        def ms(a, b):
            return None if a is None or b is None else 1000 * (b - a)

        rows.append(
            (sent, rid, [ms(sent, arrived), ms(arrived, submitted), ms(submitted, first_out),
                         ms(first_out, first), ms(sent, first)])
        )
    if not rows:
        return f"{path}: no request records"
    rows.sort()
    t0 = rows[0][0]

    def cell(v):
        return f"{v:9.1f}" if v is not None else "        -"

    out = [f"{path}: {len(rows)} requests; ms", f"{'sent':>9} {'id':>14} " +
           " ".join(f"{h:>9.9}" for h in REQUEST_PHASES)]
    for sent, rid, phases in rows[:limit]:
        out.append(f"{1000 * (sent - t0):9.1f} {rid:>14} " + " ".join(cell(v) for v in phases))
    for name, pick in (("median", statistics.median), ("max", max)):
        values = []
        for i in range(len(REQUEST_PHASES)):
            col = [p[i] for _, _, p in rows if p[i] is not None]
            values.append(pick(col) if col else None)
        out.append(f"{name:>9} {'':>14} " + " ".join(cell(v) for v in values))
    return "\n".join(out)


def pyspy(path: str, top: int) -> str:
    total, own, anywhere = 0, collections.Counter(), collections.Counter()
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        n, frames = int(count), stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            anywhere[frame] += n
    out = [f"{path}: {total} samples", "self:"]
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    out.append("inclusive:")
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in anywhere.most_common(2 * top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*")
    p.add_argument("--by-rows", action="store_true", help="median step by decoding rows")
    p.add_argument("--timeline", type=int, default=0, metavar="N", help="the first N steps")
    p.add_argument("--pyspy", default=None, metavar="FILE", help="a raw py-spy profile")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--slow", type=float, default=0, metavar="FACTOR",
                   help="the longest prompt's steps over FACTOR times the decode-only median")
    p.add_argument(
        "--requests", type=int, default=0, metavar="N", help="time to first token by phase"
    )
    ns = p.parse_args(argv)
    if ns.pyspy:
        print(pyspy(ns.pyspy, ns.top))
        return 0
    for path in ns.files:
        if ns.slow:
            print(slow_steps(path, ns.slow))
        elif ns.requests:
            print(requests(path, ns.requests))
        elif ns.timeline:
            print(timeline(path, ns.timeline))
        else:
            print(summary(path, ns.by_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
