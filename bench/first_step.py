"""Where a prompt group's first decode step spends its time, in-process.

When prompts finish their prefill, mlx-lm's ``PromptProcessingBatch.generate``
builds a ``GenerationBatch`` whose ``__init__`` runs the group's first decode
step (its first tokens). In the server's engine profile at 64 clients that call
took ~100 ms on an H200 (Qwen3-0.6B shape), against a 10-15 ms decode step of
the whole batch. This drives the engine core as the server builds it
(``make_engine_core``) through waves of ``--clients`` short prompts and, for every
such first step, times the pending device work before it (``--drain``: an
``mx.synchronize()`` first), ``mx.async_eval`` and ``mx.eval`` inside it, with the
group's size. ``python bench/first_step.py --model DIR``.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=125)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--waves", type=int, default=4)
    ns = p.parse_args()

    import mlx.core as mx

    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core
    from runtime.messages import SamplingParams, Submit

    core = make_engine_core(ServerConfig(model=ns.model, decode_concurrency=ns.clients), ns.model)
    generate = importlib.import_module("mlx_lm.generate")
    inner = generate.mx
    phases: dict[str, float] = {}

    class Timed:
        def __getattr__(self, name):
            return getattr(inner, name)

        def eval(self, *a):
            t = time.perf_counter()
            inner.eval(*a)
            phases["eval"] = phases.get("eval", 0.0) + time.perf_counter() - t

        def async_eval(self, *a):
            t = time.perf_counter()
            inner.async_eval(*a)
            phases["async_eval"] = phases.get("async_eval", 0.0) + time.perf_counter() - t

    records: list[dict] = []
    original_init = generate.GenerationBatch.__init__
    drain = [False]

    def timed_init(self, *args, **kwargs):
        phases.clear()
        t0 = time.perf_counter()
        if drain[0]:
            mx.synchronize()
        t1 = time.perf_counter()
        generate.mx = Timed()
        try:
            original_init(self, *args, **kwargs)
        finally:
            generate.mx = inner
        t2 = time.perf_counter()
        if drain[0]:
            mx.synchronize()
        t3 = time.perf_counter()
        if len(self.uids):
            records.append({"rows": len(self.uids), "drain": drain[0], "pending_ms": 1000 * (t1 - t0),
                            "init_ms": 1000 * (t2 - t1), "after_ms": 1000 * (t3 - t2),
                            **{k: 1000 * v for k, v in phases.items()}})

    generate.GenerationBatch.__init__ = timed_init
    vocab = core.handle.info.vocab_size
    rid = 0
    for wave in range(ns.waves):
        drain[0] = wave % 2 == 1
        rnd = random.Random(wave)
        for _ in range(ns.clients):
            n = ns.prompt_tokens + rnd.randrange(-3, 6)
            prompt = tuple(rnd.randrange(100, vocab - 100) for _ in range(n))
            core.handle_command(Submit(request_id=rid, prompt=prompt, segments=(prompt,),
                                       segment_types=("user",), max_tokens=ns.max_tokens,
                                       sampling=SamplingParams()))
            rid += 1
        began, steps = time.perf_counter(), 0
        first = len(records)
        while core.has_work:
            core.step()
            steps += 1
        wall = time.perf_counter() - began
        mine = records[first:]
        print(f"wave {wave} drain={drain[0]} {wall:.2f} s {steps} steps; first steps: " + "; ".join(
            f"{r['rows']} rows pending {r['pending_ms']:.1f} init {r['init_ms']:.1f} "
            f"(async_eval {r.get('async_eval', 0):.1f} eval {r.get('eval', 0):.1f}) after {r['after_ms']:.1f}"
            for r in mine), flush=True)
    warm = [r for r in records[len(records) // 4:]]
    for d in (False, True):
        sel = [r for r in warm if r["drain"] is d]
        if sel:
            print(f"drain={d}: init p50 {statistics.median(r['init_ms'] for r in sel):.1f} ms, "
                  f"async_eval p50 {statistics.median(r.get('async_eval', 0) for r in sel):.1f}, "
                  f"eval p50 {statistics.median(r.get('eval', 0) for r in sel):.1f}, "
                  f"pending p50 {statistics.median(r['pending_ms'] for r in sel):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
