"""What the engine's prompt-cache index costs its thread: mlx-lm's trie against the radix one.

For each trie (``mlx_lm.models.cache.PromptTrie``, one dict per token, and
``runtime.prompt_trie.RadixPromptTrie``), in a fresh process each and alternated
over ``--reps``: ``--entries`` entries stored as a coding agent's sessions
make them (a shared system prompt of ``--system-tokens``, then per session a
history of ``--history-tokens`` beyond it, stored turn by turn), then a lookup
of each session's next prompt. Reports the median and longest insert, the
median lookup, the objects the garbage collector tracks, the time of one full
collection with the entries held, and how many full collections the inserts set
off. ``gc.freeze()`` before the run, as the engine does after loading
(``runtime.engine.loop.settle_heap``), so only what the trie makes is walked.

    python bench/prompt_trie_cost.py --entries 16 --system-tokens 24000 \\
        --history-tokens 6000 --turns 6 --reps 3 --out RESULT.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRIES = ("mlx_lm", "radix")


def run_one(trie_name: str, ns: argparse.Namespace) -> dict:
    if trie_name == "radix":
        from runtime.prompt_trie import RadixPromptTrie as Trie
    else:
        from mlx_lm.models.cache import PromptTrie as Trie
    rng = random.Random(ns.seed)
    system = [rng.randrange(150_000) for _ in range(ns.system_tokens)]
    histories = [[rng.randrange(150_000) for _ in range(ns.history_tokens)]
                 for _ in range(ns.entries)]
    gc.collect()
    gc.freeze()
    trie = Trie()
    full_before = gc.get_stats()[2]["collections"]
    inserts, lookups = [], []
    step = max(1, ns.history_tokens // ns.turns)
    for turn in range(1, ns.turns + 1):
        for history in histories:
            tokens = system + history[: step * turn]
            began = time.perf_counter()
            trie.search("m", tokens + [7])
            lookups.append(time.perf_counter() - began)
            began = time.perf_counter()
            trie.add("m", tokens, turn)
            if turn > 1:  # mlx-lm's insert_cache drops the entry the next turn extends
                trie.pop_prefixes("m", tokens)
            inserts.append(time.perf_counter() - began)
    full_collections = gc.get_stats()[2]["collections"] - full_before
    tracked = len(gc.get_objects())
    began = time.perf_counter()
    gc.collect()
    full_ms = 1000 * (time.perf_counter() - began)
    return {
        "trie": trie_name,
        "insert_p50_ms": 1000 * statistics.median(inserts),
        "insert_max_ms": 1000 * max(inserts),
        "lookup_p50_ms": 1000 * statistics.median(lookups),
        "tracked_objects": tracked,
        "full_collection_ms": full_ms,
        "full_collections_during_inserts": full_collections,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=16, help="sessions, each with its own history")
    p.add_argument("--system-tokens", type=int, default=24000)
    p.add_argument("--history-tokens", type=int, default=6000)
    p.add_argument("--turns", type=int, default=6, help="stores per session, the history growing")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--one", choices=TRIES, help=argparse.SUPPRESS)  # a child process's trie
    ns = p.parse_args(argv)
    if ns.one:
        print(json.dumps(run_one(ns.one, ns)))
        return 0
    root = Path(__file__).resolve().parent.parent
    child = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--out"]
    if ns.out:
        child = [a for a in child if a != ns.out]
    results = []
    for rep in range(ns.reps):
        for name in TRIES:
            out = subprocess.run([sys.executable, __file__, *child, "--one", name], cwd=root,
                                 check=True, capture_output=True, text=True).stdout
            result = json.loads(out) | {"rep": rep}
            results.append(result)
            print(json.dumps(result), flush=True)
    print(f"{'trie':7} {'insert p50':>10} {'max':>8} {'lookup p50':>10} {'objects':>9} "
          f"{'full gc ms':>10} {'full gcs':>8}")
    for r in results:
        print(f"{r['trie']:7} {r['insert_p50_ms']:10.2f} {r['insert_max_ms']:8.1f} "
              f"{r['lookup_p50_ms']:10.2f} {r['tracked_objects']:9d} "
              f"{r['full_collection_ms']:10.1f} {r['full_collections_during_inserts']:8d}")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
