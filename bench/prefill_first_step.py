"""A long prompt's first prefill steps beside decoding streams, in-process: the
engine's step order (a step with no decode run ahead takes its chunk first)
against mlx-lm's (decode, then the chunk with the next step's decode).

Drives the engine core as the server builds it (``make_engine_core``, OpenBLAS on
a Linux CPU): ``--streams``
short prompts decode, then a prompt of ``--long-tokens`` arrives, and every step
until its prefill ends is timed and its forward passes counted (the last: the step
after its last chunk, which moves it into decoding). Rounds alternate
the two orders (``runtime.engine_generator.ChunkGoesFirst``; mlx-lm's by turning it off
in this process), after one unmeasured round of each. Per round it prints the
prompt's first step, the median of the next ten, the slowest, and the step after
its last chunk; ``--json-out`` keeps every step and the prompt's progress.

    python bench/prefill_first_step.py --model DIR --long-tokens 6000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ORDERS = ("chunk-first", "mlx-lm")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=6000)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds of each order")
    p.add_argument("--cpu-blas", default="openblas", choices=("openblas", "reference"),
                   help="on a Linux CPU, MLX's matrix products as the server's engine runs them")
    p.add_argument("--json-out")
    ns = p.parse_args()

    from runtime.cpu_blas import load_into_this_process

    load_into_this_process(ns.cpu_blas)  # before MLX is imported

    from in_process import RandomPrompts

    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core
    from runtime.engine_generator import ChunkGoesFirst
    from runtime.messages import Abort

    core = make_engine_core(ServerConfig(model=ns.model, decode_concurrency=64), ns.model)
    chunk_goes_first = ChunkGoesFirst._chunk_goes_first
    # Forward passes: the model's own calls, and the passes a decode and a chunk share.
    model_class = type(core.handle.model)
    model_call = model_class.__call__
    calls = [0]

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return model_call(self, *args, **kwargs)

    model_class.__call__ = counted
    mixer = core._batch._prompt_batch.model

    def passes() -> int:
        return calls[0] + getattr(mixer, "mixed_passes", 0)

    submit = RandomPrompts(core).submit

    def one_round(order: str) -> dict:
        ChunkGoesFirst._chunk_goes_first = (
            chunk_goes_first if order == "chunk-first" else lambda self: False)
        for i in range(ns.streams):
            submit(100 + i, 100_000)
        for _ in range(30):
            core.step()
        long_id = submit(ns.long_tokens, 2)
        # Each step's time, the prompt's progress after it and the passes it ran.
        steps, done, step_passes = [], [], []
        while not done or done[-1] < ns.long_tokens:
            before = passes()
            began = time.perf_counter()
            out = core.step()
            ms = 1000 * (time.perf_counter() - began)
            progress = [pp.done for pp in out.progress if pp.request_id == long_id]
            if progress or done:  # from its first chunk on (an admission window may hold it)
                steps.append(ms)
                done.append(progress[-1] if progress else done[-1])
                step_passes.append(passes() - before)
        for request_id in list(core.active_request_ids):
            core.handle_command(Abort(request_id=request_id))
        while core.has_work:
            core.step()
        return {"order": order, "steps_ms": steps, "done": done, "passes": step_passes}

    for order in ORDERS:  # warm-up: every chunk size and batch size met once
        one_round(order)
    results = []
    for r in range(ns.rounds):
        for order in ORDERS if r % 2 == 0 else ORDERS[::-1]:
            res = one_round(order)
            steps = res["steps_ms"]
            slowest = max(range(len(steps)), key=steps.__getitem__)
            print(f"{order:12s} first {steps[0]:6.1f} ms ({res['passes'][0]} passes)  next ten p50 "
                  f"{statistics.median(steps[1:11]):6.1f}  slowest {steps[slowest]:6.1f} "
                  f"(at {res['done'][slowest]} tokens)  "
                  f"after the last chunk {steps[-1]:6.1f} ({res['passes'][-1]} passes)  "
                  f"({len(steps)} steps)", flush=True)
            results.append(res)
    ChunkGoesFirst._chunk_goes_first = chunk_goes_first
    model_class.__call__ = model_call
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({"args": vars(ns), "rounds": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
