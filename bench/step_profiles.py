"""Where the engine's steps spend their host time while a long prompt is prefilled.

Reads what an engine process leaves with ``MLX_TRIO_ENGINE_PROBE=PATH`` and
``MLX_TRIO_ENGINE_SLOW_STEP_MS`` set (``runtime.engine.host_speed``): its step trace
``PATH-steps.PID`` and a cProfile dump ``PATH-slow-EPOCH.PID`` of every step slower
than that. For each process, the steps while a prompt of at least ``--min-total``
tokens was prefilled beside at least ``--decoding`` generating sequences, in three
kinds: steps that prefilled a chunk of it, steps that only carried a chunk's later
layers (``--prefill-chunk-parts``: no prompt progress) and the decode-only steps
before it. Per kind: how many steps were profiled, their mean wall time, and the
functions with the most own time (mean milliseconds per step), then a few of the
engine's own functions by cumulative time. Functions of MLX that wait for the
device (``eval``, ``item``, ``tolist``) show there as their own time.

    python bench/step_profiles.py OUT_DIR [--min-total 20000] [--top 25]

Prints text; ``bench/device.sh`` runs it where a run leaves many profiles (too many
to bring back) and keeps its summary instead.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import pstats

# The engine's functions whose cumulative time tells a step's parts apart.
CUMULATIVE = ("_next", "_decode", "_decode_carrying", "_share_pass", "_next_part",
              "_forward", "prompt", "_step", "settle", "before", "after")


def step_kinds(steps_path: str, min_total: int, decoding: int) -> dict[str, str]:
    """Each step's start (as the profile's file name has it) -> its kind."""
    steps = []
    for line in open(steps_path):
        fields = line.split()
        if fields[0] == "S" and int(fields[3]) >= decoding:
            progress = fields[8]
            long = any(int(p.split("/")[1]) >= min_total for p in progress.split(",")
                       if "/" in p)
            steps.append((fields[1], long, progress == "-"))
    window = [i for i, (_, long, _) in enumerate(steps) if long]
    if not window:
        return {}
    kinds = {}
    for i, (began, long, idle) in enumerate(steps):
        if long:
            kinds[began] = "chunk"
        elif idle and window[0] < i < window[-1]:
            kinds[began] = "carry"
        elif idle and i < window[0]:
            kinds[began] = "decode"
    return kinds


def summarize(out_dir: str, min_total: int, decoding: int, top: int) -> str:
    lines = []
    for steps_path in sorted(glob.glob(os.path.join(out_dir, "*-steps.*"))):
        pid = steps_path.rsplit(".", 1)[1]
        prefix = steps_path[: -len(f"-steps.{pid}")]
        kinds = step_kinds(steps_path, min_total, decoding)
        own = {k: collections.Counter() for k in ("chunk", "carry", "decode")}
        cumulative = {k: collections.Counter() for k in own}
        count, wall = collections.Counter(), collections.Counter()
        for path in glob.glob(f"{prefix}-slow-*.{pid}"):
            kind = kinds.get(path[len(prefix) + len("-slow-"):].rsplit(".", 1)[0])
            if kind is None:
                continue
            stats = pstats.Stats(path)
            count[kind] += 1
            wall[kind] += stats.total_tt
            for (file, _line, name), (_, _, tottime, cumtime, _) in stats.stats.items():
                where = f"{os.path.basename(file)}:{name}"
                own[kind][where] += tottime
                if name in CUMULATIVE and file.endswith(".py"):
                    cumulative[kind][where] += cumtime
        if not count:
            continue
        lines.append(f"== {os.path.basename(steps_path)}")
        for kind in ("chunk", "carry", "decode"):
            n = count[kind]
            if not n:
                continue
            lines.append(f"  {kind}: {n} steps profiled, {1000 * wall[kind] / n:.1f} ms each "
                         "(profiled time)")
            for where, seconds in own[kind].most_common(top):
                lines.append(f"    own {1000 * seconds / n:8.2f}  {where}")
            for where, seconds in cumulative[kind].most_common():
                lines.append(f"    cum {1000 * seconds / n:8.2f}  {where}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--min-total", type=int, default=20000,
                   help="a prompt of at least this many tokens is the long one")
    p.add_argument("--decoding", type=int, default=16,
                   help="steps with fewer generated tokens are left out")
    p.add_argument("--top", type=int, default=25, help="functions by own time per kind")
    ns = p.parse_args()
    print(summarize(ns.out_dir, ns.min_total, ns.decoding, ns.top))


if __name__ == "__main__":
    main()
