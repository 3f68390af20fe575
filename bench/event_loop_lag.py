"""How long the API's event loop stands still while a long prompt is prepared.

The API prepares a long request's prompt (chat template, then tokens) in a
worker thread, as ``actors.session`` does, while its trio loop writes every
other client's stream. A thread that holds the GIL stops that loop. This
prepares chat prompts of several sizes in a worker thread while a task on the
loop sleeps 1 ms at a time, and reports the preparation's time and the
longest the loop went without running (its lag), for two encoders alternated
rep by rep:

* ``server``: ``runtime.tokenizing``'s, as the server prepares prompts;
* ``one-text``: the tokenizer backend's single-text ``encode``, which holds the
  GIL while Rust encodes.

    .venv/bin/python bench/event_loop_lag.py --model DIR --tokens 2000,12000,30000

Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import PromptBuilder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the tiny model, built here)")
    p.add_argument("--tokens", default="2000,12000,30000", help="prompt sizes, comma separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="write the JSON here")
    ns = p.parse_args(argv)

    import trio
    from mlx_lm.utils import load_tokenizer

    from runtime import tokenizing
    from runtime.prompts import prepare_chat

    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path("/tmp/event-loop-lag-model"), seed=0))
    tokenizer = load_tokenizer(Path(model))
    builder = PromptBuilder(model)
    server_encoder = tokenizing.encoder_for(tokenizer)
    backend = tokenizer._tokenizer._tokenizer

    def one_text(text: str, add_special_tokens: bool) -> list[int]:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    encoders = {"server": server_encoder, "one-text": one_text}
    results = []

    async def measure(size: int, rep: int, way: str) -> dict:
        rng = random.Random(f"{size}-{rep}")
        messages = [{"role": "system", "content": builder.words(size, rng, lead=f"r{rep}")},
                    {"role": "user", "content": "list the files"}]
        lags: list[float] = []

        async def ticker() -> None:
            while True:
                began = time.perf_counter()
                await trio.sleep(0.001)
                lags.append(1000 * (time.perf_counter() - began))

        tokenizing._encoders[tokenizer] = encoders[way]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.05)
            lags.clear()
            began = time.perf_counter()
            prompt = await trio.to_thread.run_sync(
                lambda: prepare_chat(tokenizer, messages, tools=None, template_args={}))
            prep_ms = 1000 * (time.perf_counter() - began)
            nursery.cancel_scope.cancel()
        return {"size": size, "tokens": len(prompt.tokens), "way": way, "rep": rep, "prepare_ms": prep_ms,
                "loop_max_lag_ms": max(lags, default=prep_ms), "loop_wakeups": len(lags)}

    for size in (int(t) for t in ns.tokens.split(",")):
        for rep in range(ns.reps):
            ways = list(encoders) if rep % 2 == 0 else list(encoders)[::-1]
            for way in ways:
                results.append(trio.run(measure, size, rep, way))
    tokenizing._encoders[tokenizer] = server_encoder
    print(f"{'size':>7} {'encoder':9} {'prepare ms p50':>14} {'loop lag max p50':>16} "
          f"{'wakeups p50':>11}")
    for size in sorted({r["size"] for r in results}):
        for way in encoders:
            rows = [r for r in results if r["size"] == size and r["way"] == way]
            if not rows:
                continue
            print(f"{size:>7} {way:9} {statistics.median(r['prepare_ms'] for r in rows):14.1f} "
                  f"{statistics.median(r['loop_max_lag_ms'] for r in rows):16.1f} "
                  f"{statistics.median(r['loop_wakeups'] for r in rows):11.0f}")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
