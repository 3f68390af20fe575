"""Summaries of per-step engine traces and of py-spy's raw profiles, for issue 15's notes.

Reads the files ``engine_overhead.py --trace DIR`` writes (``S began ended tokens finished
prefill -`` per step, ``C epoch Submit request`` per arrival; a server's come from its engine
process, ``runtime.engine.host_speed.ProbeLog.trace_steps``, with the number of prompts
prefilled in place of ``prefill``) and prints, per file: tokens/s over the traced span, the
time the engine spent stepping, the prefill steps (count, time, decoding rows they carried
on average) and the other steps, then the median step by decoding rows (``--by-rows``), or
each step (``--timeline N``: the first N, with the arrivals handled before each).

``--pyspy FILE`` instead sums a ``py-spy record -f raw`` profile: the share of samples
per innermost frame (self) and per frame anywhere on the stack (inclusive).

    python bench/trace_summary.py trace/*-c32-r1.txt --by-rows
    python bench/trace_summary.py trace/server-c32-r1.txt --timeline 60
    python bench/trace_summary.py --pyspy pyspy-engine.txt
"""

from __future__ import annotations

import argparse
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
        by = collections.defaultdict(list)
        for s in other:
            by[int(s[3])].append(1000 * (float(s[2]) - float(s[1])))
        for rows in sorted(by):
            durations = by[rows]
            out.append(
                f"    {rows:3d} rows: {len(durations):4d} steps, p50 "
                f"{statistics.median(durations):6.1f} ms, {sum(durations):7.0f} ms in all"
            )
    return "\n".join(out)


def timeline(path: str, limit: int) -> str:
    lines = read_steps(path)
    t0 = float(lines[0][1])
    out, arrivals, previous_end = [], 0, None
    for s in lines:
        if s[0] == "C":
            arrivals += s[2] == "Submit"
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
    ns = p.parse_args(argv)
    if ns.pyspy:
        print(pyspy(ns.pyspy, ns.top))
        return 0
    for path in ns.files:
        print(timeline(path, ns.timeline) if ns.timeline else summary(path, ns.by_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
