"""What the engine's prompt-cache store costs its thread for coding agents' sessions.

``runtime.prompt_cache_store.PromptCacheStore`` as the engine drives it, with
KV layers of one head of width 2 (so that the arrays cost nothing and what is
timed is the store's own work: its index, its shared spans, mlx-lm's
``LRUPromptCache`` around them): ``--sessions`` sessions over one system
prompt of ``--system-tokens``, each turn a lookup of the next prompt, then the
store of its user segment and of the finished reply, as the engine stores
them (turns of 200-500 tokens, replies of 64-256). Each build (``--tree
NAME=DIR``: a checkout whose ``runtime`` is imported instead of this one's,
such as a ``git worktree`` of the build before) runs in a fresh process,
alternated over ``--reps``; after loading, the heap is frozen, as the engine's
is. Reports per kind of call the median and the longest, the objects the
garbage collector tracks at the end, and one full collection's time.

    python bench/prompt_cache_store_cost.py --sessions 16 --system-tokens 24000 \\
        --turns 6 --tree before=/tmp/before --reps 3 --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_one(ns: argparse.Namespace) -> dict:
    import gc
    import random
    import statistics
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from runtime.prompt_cache_store import PromptCacheStore

    def layers(n: int) -> list:
        layer = KVCache()
        kv = mx.zeros((1, 1, n, 2), dtype=mx.float16)
        layer.update_and_fetch(kv, kv)
        mx.eval(layer.keys, layer.values)
        return [layer]

    rng = random.Random(ns.seed)
    system = [rng.randrange(150_000) for _ in range(ns.system_tokens)]
    histories: list[list[int]] = [[] for _ in range(ns.sessions)]
    gc.collect()
    gc.freeze()
    store = PromptCacheStore()
    times: dict[str, list[float]] = {"lookup": [], "user": [], "assistant": []}
    store.insert_cache("m", system, layers(len(system)), cache_type="system")
    for _ in range(ns.turns):
        for s in range(ns.sessions):
            prompt = system + histories[s] + [rng.randrange(150_000)
                                              for _ in range(rng.randrange(200, 500))]
            began = time.perf_counter()
            store.fetch_nearest_cache("m", prompt)
            times["lookup"].append(time.perf_counter() - began)
            kv = layers(len(prompt))
            began = time.perf_counter()
            store.insert_cache("m", prompt, kv, cache_type="user")
            times["user"].append(time.perf_counter() - began)
            full = prompt + [rng.randrange(150_000) for _ in range(rng.randrange(64, 256))]
            kv = layers(len(full))
            began = time.perf_counter()
            store.insert_cache("m", full, kv, cache_type="assistant")
            times["assistant"].append(time.perf_counter() - began)
            histories[s] = full[len(system):]
    tracked = len(gc.get_objects())
    began = time.perf_counter()
    gc.collect()
    full_ms = 1000 * (time.perf_counter() - began)
    result: dict = {"tracked_objects": tracked, "full_collection_ms": full_ms}
    for kind, values in times.items():
        result[f"{kind}_p50_ms"] = 1000 * statistics.median(values)
        result[f"{kind}_max_ms"] = 1000 * max(values)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=24000)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="another checkout's runtime, measured beside this one's")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    ns = p.parse_args(argv)
    if ns.one:
        print(json.dumps(run_one(ns)))
        return 0
    builds = {"this": ROOT} | {name: Path(d).resolve() for name, d in (t.split("=", 1) for t in ns.tree)}
    child = [sys.executable, __file__, "--one", "--sessions", str(ns.sessions),
             "--system-tokens", str(ns.system_tokens), "--turns", str(ns.turns), "--seed", str(ns.seed)]
    results = []
    for rep in range(ns.reps):
        for name, tree in builds.items():
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run(child, cwd=tree, env=env, check=True, capture_output=True,
                                 text=True).stdout
            result = json.loads(out) | {"build": name, "rep": rep}
            results.append(result)
            print(json.dumps(result), flush=True)
    kinds = ("lookup", "user", "assistant")
    print(f"{'build':8} " + " ".join(f"{k + ' p50/max':>18}" for k in kinds)
          + f" {'objects':>9} {'full gc ms':>10}")
    for r in results:
        cells = " ".join(f"{r[k + '_p50_ms']:8.2f}/{r[k + '_max_ms']:<9.2f}" for k in kinds)
        print(f"{r['build']:8} {cells} {r['tracked_objects']:9d} {r['full_collection_ms']:10.1f}")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
