"""Sessions over one cached system prompt starting together: where the engine's steps go, in-process.

Coding agents' sessions share a long system prompt. Once it is cached, each session's
first turn starts from it and prefills only its own user turn, and sessions that start
together do that in one prompt batch (up to the prompt concurrency, 8). On an H100
(Qwen3-0.6B shape, docs/performance.md) such a step of eight rows after a 12k-token
prefix took 378 ms, where a decode step of sixteen rows at that depth takes 15.

This drives the engine core as the server builds it (``make_engine_core``, the server's
defaults): one request caches a system prompt of ``--prefix`` tokens, then waves of
``--rows`` requests arrive together, each that system prompt and a user turn of
``--suffix`` tokens (LO-HI, drawn per request), one new token each. Per step that
prefilled user turns it prints the wall time and the time in each part, each ending
with its arrays evaluated and ``mx.synchronize()``, so that its device work counts in
it (``--no-sync``: the host's times alone, the device's work landing wherever the host
next waits):

- ``fetch``: the prompt cache's copies of the cached prefix, one per row
  (``PromptCacheStore.fetch_nearest_cache``), made as the requests reach the engine,
  in the step or before it (not part of the step's wall time then);
- ``merge``: mlx-lm's merge of the rows' caches into the prompt batch's
  (``BatchKVCache.merge``);
- ``prefill``: the prompt batch's ``prompt`` (the forward pass over the user turns),
  less ``align`` and ``attention``;
- ``attention``: every layer's attention over the prefix and the user turns (each call
  of ``mx.fast.scaled_dot_product_attention`` as the server installs it, evaluated);
- ``align``: the rows rolled to end together (``BatchKVCache.finalize``, by slices
  in the server: ``runtime.batch_layers``);
- ``rest``: the step's other work (the first token, the split into the decoding batch,
  the prompt cache's inserts).

The first wave is a warm-up (its kernels built); each later wave's longest step is
summarised by its medians. ``--json-out`` writes every step's record.

    python bench/prompt_wave.py --model DIR --prefix 12000 --rows 8 --suffix 200-500
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("fetch", "merge", "prefill", "attention", "align")


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the tiny test model)")
    p.add_argument("--prefix", type=int, default=12000, help="the system prompt's tokens")
    p.add_argument("--rows", type=int, default=8, help="requests a wave")
    p.add_argument("--suffix", type=parse_range, default=(200, 500), help="user turn: LO-HI")
    p.add_argument("--waves", type=int, default=4, help="waves, the first a warm-up")
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="time the parts on the host only (no mx.synchronize after each)")
    p.add_argument("--server-args", default="", help="settings, as the server's flags")
    p.add_argument("--json-out")
    ns = p.parse_args(argv)

    import shlex
    import tempfile

    import mlx.core as mx
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import BatchKVCache

    from api.cli import parse_config
    from runtime import batch_layers
    from runtime.engine.loading import make_engine_core
    from runtime.prompt_cache_store import PromptCacheStore

    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        folder = tempfile.mkdtemp(prefix="prompt-wave-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        model = str(build_tiny_model(folder))
    config = parse_config(["--model", model, *shlex.split(ns.server_args)])
    core = make_engine_core(config, model)

    spent: dict[str, float] = {}  # seconds by part since the step began

    @contextlib.contextmanager
    def part(name: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            if ns.sync:
                mx.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - began

    def arrays(value) -> list:
        """The arrays a part made: its result's, or its first argument's (a cache
        changed in place)."""
        if isinstance(value, mx.array):
            return [value]
        if isinstance(value, (list, tuple)):
            return [a for v in value for a in arrays(v)]
        state = getattr(value, "keys", None), getattr(value, "values", None)
        return [a for a in state if isinstance(a, mx.array)]

    def timed(name, function):
        def wrapper(*args, **kwargs):
            with part(name):
                result = function(*args, **kwargs)
                if ns.sync:  # lazy arrays are not the device's work until evaluated
                    mx.eval(arrays(result) + (arrays(args[0]) if args else []))
                return result
        wrapper.__dict__.update(getattr(function, "__dict__", {}))  # the install's attributes
        wrapper.__wrapped__ = function  # mlx-lm's source, where a check reads it
        return wrapper

    fused = mx.fast.scaled_dot_product_attention

    def attention(queries, keys, values, *args, **kwargs):
        """The installed attention of a prefill (more than one query), timed on its own:
        its inputs evaluated first, out of the timing (else their lazy layers would count
        in it). A decode's (one query, outside the prompt's pass) is not timed."""
        if queries.shape[2] == 1:
            return fused(queries, keys, values, *args, **kwargs)
        if ns.sync:
            mask = kwargs.get("mask")
            mx.eval([queries, keys, values, *([mask] if isinstance(mask, mx.array) else [])])
            mx.synchronize()
        with part("attention"):
            out = fused(queries, keys, values, *args, **kwargs)
            if ns.sync:
                mx.eval(out)
        return out

    attention.__dict__.update(getattr(fused, "__dict__", {}))  # the install's attributes

    patches = (
        (mx.fast, "scaled_dot_product_attention", attention),
        (PromptCacheStore, "fetch_nearest_cache", timed("fetch", PromptCacheStore.fetch_nearest_cache)),
        (BatchKVCache, "merge", classmethod(timed("merge", BatchKVCache.merge.__func__))),
        (PromptProcessingBatch, "prompt", timed("prefill", PromptProcessingBatch.prompt)),
        (batch_layers, "_finalize_rolled", timed("align", batch_layers._finalize_rolled)),
        (BatchKVCache, "finalize", timed("align", BatchKVCache.finalize)),
    )
    originals = [(owner, name, getattr(owner, name) if owner is mx.fast else owner.__dict__[name])
                 for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        return _waves(ns, core, mx, spent, model)
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def _waves(ns, core, mx, spent: dict, model: str) -> int:
    """The system prompt cached, then ``ns.waves`` waves; prints and writes the records."""
    from runtime.messages import SamplingParams, Submit

    vocab = core.handle.info.vocab_size

    rnd = random.Random(0)
    system = tuple(rnd.randrange(100, vocab - 100) for _ in range(ns.prefix))
    rid = 0

    def submit(user: tuple[int, ...]) -> None:
        nonlocal rid
        core.handle_command(Submit(
            request_id=rid, prompt=system + user, segments=(system, user),
            segment_types=("system", "user"), max_tokens=1, sampling=SamplingParams()))
        rid += 1

    def run() -> list[dict]:
        steps = []
        while core.has_work:
            fetched = spent.pop("fetch", 0.0)  # as the requests were handed to the engine
            spent.clear()
            began = time.perf_counter()
            outputs = core.step()
            wall = 1000 * (time.perf_counter() - began)
            rows = len({q.request_id for q in outputs.progress})
            if rows and "prefill" in spent:  # (a prefill step: its attention is inside it)
                ms = {k: 1000 * v for k, v in spent.items()}
                # The align and the attention run inside the prefill's prompt: the
                # prefill is the rest.
                ms["prefill"] -= ms.get("align", 0.0) + ms.get("attention", 0.0)
                ms["rest"] = wall - sum(ms.values())
                ms["fetch"] = ms.get("fetch", 0.0) + 1000 * fetched
                steps.append({"wall_ms": wall, "rows": rows, **ms})
            else:
                spent["fetch"] = fetched + spent.get("fetch", 0.0)
        return steps

    submit(tuple(rnd.randrange(100, vocab - 100) for _ in range(ns.suffix[0])))
    run()  # the system prompt cached
    records = []
    for wave in range(ns.waves):
        for _ in range(ns.rows):
            n = rnd.randint(*ns.suffix)
            submit(tuple(rnd.randrange(100, vocab - 100) for _ in range(n)))
        for step in run():
            step["wave"] = wave
            records.append(step)
            print(f"wave {wave}: {step['rows']} rows {step['wall_ms']:.1f} ms: " + ", ".join(
                f"{k} {step.get(k, 0.0):.1f}" for k in (*PARTS, "rest")), flush=True)
    # Each wave's longest step (its rows' user turns prefilled), medians over the waves
    # after the first.
    longest = {}
    for r in records:
        if r["wave"] not in longest or r["wall_ms"] > longest[r["wave"]]["wall_ms"]:
            longest[r["wave"]] = r
    measured = [r for w, r in longest.items() if w > 0] or list(longest.values())
    summary = {k: round(statistics.median(r.get(k, 0.0) for r in measured), 2)
               for k in ("wall_ms", *PARTS, "rest")}
    print("each wave's longest step, medians over the waves after the first (ms): " + ", ".join(
        f"{k} {v:.1f}" for k, v in summary.items()))
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({
            "argv": sys.argv, "model": model, "prefix": ns.prefix, "rows": ns.rows,
            "suffix": ns.suffix, "sync": ns.sync, "device": str(mx.default_device()),
            "records": records, "medians": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
