"""Ratios of an ``engine_overhead.py`` run read only where the host ran at like speed.

On the H200's host a run's speed follows the vCPU it lands on (a fixed Python loop
timed on the engine's thread, ``probe us``, 15 us on a fast core, up to 30 on a slow
one), so the medians of a level's rounds can pair a system's fast rounds with another's
slow ones. This reads ``--json-out`` files and prints, per level and system, every
pair of rounds (system, base) whose probe medians lie within ``--within`` us: the
tokens/s ratio and both probes; levels with no such pair say so.

    python bench/like_for_like.py bench/results/h200-many-clients/qwen3-0.6b-greedy.json
    python bench/like_for_like.py run.json --base ceiling --within 1.5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def like_pairs(runs: list[dict], base_runs: list[dict], within: float) -> list[tuple]:
    """(ratio, base probe, probe) for every pair of rounds at like probes."""
    pairs = []
    for base in base_runs:
        for run in runs:
            a, b = base.get("probe_us_p50"), run.get("probe_us_p50")
            if a is None or b is None or abs(a - b) > within or not base.get("tok_s"):
                continue
            pairs.append((run["tok_s"] / base["tok_s"], a, b))
    return sorted(pairs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--base", default="ceiling", help="the system the others are divided by")
    p.add_argument("--within", type=float, default=1.5, help="us between the probes, at most")
    ns = p.parse_args()
    for path in ns.files:
        results = json.loads(Path(path).read_text())["results"]
        print(path)
        for level, systems in results.items():
            base_runs = systems.get(ns.base)
            if base_runs is None:
                continue
            for name, runs in systems.items():
                if name == ns.base:
                    continue
                pairs = like_pairs(runs, base_runs, ns.within)
                shown = ", ".join(f"{r:.2f} ({a:.1f}/{b:.1f} us)" for r, a, b in pairs)
                print(f"  c={level:<3} {name:<10} / {ns.base}: {shown or 'no pair at like speed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
