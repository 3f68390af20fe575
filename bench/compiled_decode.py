"""Does fewer operations per decode step move the step time? The compiled decode path, bare.

Owns one measurement: the bare mlx-lm ``BatchGenerator`` decoding with its
model as mlx-lm builds it ("stock") against the same model whose decoder
layers run each decode step (one token per row, a batch KV cache whose offsets
are an array) through two ``mx.compile``d pieces: everything before the KV
cache (norm, q/k/v projections, q/k norms, RoPE) and everything after the
attention (output projection, residual, norm, MLP, residual). The cache update
and the attention stay as mlx-lm has them, so shapes that change every step
never enter a compiled function. Per layer that turns about thirty operations
built from Python into two compiled calls, and lets MLX fuse the element-wise
ones.

Both variants run in one process on one thread, alternated rep by rep (the
switch is read at each layer call), after a warm-up of each; each rep decodes
``--max-tokens`` tokens for ``--rows`` sequences and reports the p50 of the
time between ``next()`` calls and the host-speed probe. Tokens are compared:
the compiled layers must give the stock model's greedy tokens. Two compiled
variants: "layer" (each layer's own compiled pieces, its weights constants)
and "shared" (one pair for all layers, the weights passed in).

  python bench/compiled_decode.py --model M --rows 1,32 --reps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.compiled_decode import (  # noqa: E402
    _after_attention,
    _before_cache,
    install_compiled_decode,
)
from runtime.engine.host_speed import cpu_probe_us  # noqa: E402

SWITCH: dict = {}
VARIANTS = ("stock", "layer", "shared")


class _LayerPair:
    """The per-layer variant: one layer's own compiled pieces, its weights constants of the trace."""

    broken = False  # runtime.compiled_decode's fallback flag: never set here

    def __init__(self, layer):
        import mlx.core as mx

        before = mx.compile(lambda x, o: _before_cache(layer, x, o))
        after = mx.compile(lambda x, a: _after_attention(layer, x, a))
        self.before_cache = lambda x, o, *_: before(x, o)  # the layer's weights: constants
        self.after_attention = lambda x, a, *_: after(x, a)


def patch_layers(model) -> int:
    """Prepare the three variants on ``model``'s layers; ``use(variant)`` switches between them.

    "stock": mlx-lm's layers; "shared": ``runtime.compiled_decode`` as the
    server installs it; "layer": its decode path with each layer's own pieces.
    """
    stock = [type(layer) for layer in model.layers]
    count = install_compiled_decode(model)
    compiled = [type(layer) for layer in model.layers]
    shared = [getattr(layer, "_compiled_decode", None) for layer in model.layers]
    own = [_LayerPair(layer) if pair is not None else None
           for layer, pair in zip(model.layers, shared, strict=True)]

    def use(variant: str) -> None:
        for i, layer in enumerate(model.layers):
            if shared[i] is None:
                continue
            layer.__class__ = stock[i] if variant == "stock" else compiled[i]
            layer._compiled_decode = own[i] if variant == "layer" else shared[i]

    SWITCH["use"] = use
    use("stock")
    return count


def one_rep(gen, prompts: list[list[int]], max_tokens: int) -> dict:
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    steps, probes = [], []
    last = None
    left = set(uids)
    while left:
        _, responses = gen.next()
        if not responses:
            continue
        now = time.perf_counter()
        probes.append(cpu_probe_us())
        if last is not None and len(responses) == len(prompts):
            steps.append(now - last)
        last = time.perf_counter()
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
    ms = [s * 1000 for s in steps]
    return {
        "p50_ms": statistics.median(ms) if ms else float("nan"),
        "probe_us_p50": statistics.median(probes),
        "tokens": [tokens[u] for u in uids],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=136)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    import mlx.core as mx
    from loadgen import PromptBuilder, Workload
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        model, tokenizer = load(ns.model)
    patched = patch_layers(model)
    print(f"compiled decode path on {patched} of {len(model.layers)} layers", flush=True)
    builder = PromptBuilder(ns.model)
    w = Workload(prompt_tokens=ns.prompt_tokens, max_tokens=ns.max_tokens, endpoint="chat",
                 system_prompt_tokens=0, seed=0)

    def prompt(i: int) -> list[int]:
        return list(tokenizer.apply_chat_template(
            builder.messages(w, i), add_generation_prompt=True, tokenize=True))

    gen = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64, stream=stream)
    results: dict[str, list[dict]] = {}
    mismatches = 0
    for rows in [int(r) for r in ns.rows.split(",")]:
        prompts = [prompt(i) for i in range(rows)]
        for variant in VARIANTS:  # warm-up: kernels and traces
            SWITCH["use"](variant)
            began = time.perf_counter()
            one_rep(gen, prompts, 8)
            print(f"rows {rows:3d} warm-up {variant}: {1000 * (time.perf_counter() - began):.0f} ms"
                  " (8 tokens, first use of this batch size)", flush=True)
        for rep in range(ns.reps):
            order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
            got = {}
            for variant in order:
                SWITCH["use"](variant)
                r = one_rep(gen, prompts, ns.max_tokens)
                got[variant] = r.pop("tokens")
                results.setdefault(f"{variant}@{rows}", []).append(r)
            differ = [v for v in VARIANTS if got[v] != got["stock"]]
            mismatches += bool(differ)
            s = results[f"stock@{rows}"][-1]
            line = " ".join(
                f"{v} {results[f'{v}@{rows}'][-1]['p50_ms']:.2f} ms "
                f"(probe {results[f'{v}@{rows}'][-1]['probe_us_p50']:.1f}, "
                f"{results[f'{v}@{rows}'][-1]['p50_ms'] / s['p50_ms']:.3f})" for v in VARIANTS)
            print(f"rows {rows:3d} rep {rep}: {line}"
                  f"{'  TOKENS DIFFER: ' + ','.join(differ) if differ else ''}", flush=True)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(results))
    print(f"token mismatches: {mismatches}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
