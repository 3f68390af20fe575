"""Does fewer operations per decode step move the step time? A probe for issue 15.

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

from runtime.engine.host_speed import cpu_probe_us  # noqa: E402

MODE = {"how": "stock"}
VARIANTS = ("stock", "layer", "shared")


def _pre(layer, x, offset):
    """Everything of a decoder layer's decode step before its KV cache."""
    attn = layer.self_attn
    B, L, _ = x.shape
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).reshape(B, L, attn.n_heads, -1)
    k = attn.k_proj(h).reshape(B, L, attn.n_kv_heads, -1)
    v = attn.v_proj(h).reshape(B, L, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def _post(layer, x, out):
    """Everything of a decoder layer's decode step after its attention."""
    B, _, L, _ = out.shape
    h = x + layer.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def patch_layers(model) -> int:
    """Give each llama / qwen3 decoder layer a compiled decode path; returns how many.

    MODE["how"] picks it per call: "stock" (mlx-lm's), "layer" (two compiled
    closures per layer, its weights constants of the trace) or "shared" (two
    compiled functions for all layers, the layer's weights inputs of the trace:
    one trace per batch size for the whole model).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama, qwen3
    from mlx_lm.models.base import scaled_dot_product_attention

    layers = [layer for layer in model.layers
              if type(layer) in (llama.TransformerBlock, qwen3.TransformerBlock)]
    if not layers:
        return 0
    template = layers[0]
    names = [name for name, _ in tree_flatten(template.parameters())]

    def with_weights(fn):
        def run(x, y, *leaves):
            saved = template.parameters()
            template.update(tree_unflatten(list(zip(names, leaves, strict=True))))
            try:
                return fn(template, x, y)
            finally:
                template.update(saved)
        return mx.compile(run)

    shared_pre, shared_post = with_weights(_pre), with_weights(_post)
    subclasses: dict[type, type] = {}
    for layer in layers:
        base = type(layer)
        layer._decode_leaves = [v for _, v in tree_flatten(layer.parameters())]
        layer._decode_pre = mx.compile(lambda x, o, layer=layer: _pre(layer, x, o))
        layer._decode_post = mx.compile(lambda x, a, layer=layer: _post(layer, x, a))
        if base not in subclasses:

            def call(self, x, mask=None, cache=None, _base=base):
                how = MODE["how"]
                if (how == "stock" or x.shape[1] != 1 or cache is None
                        or not isinstance(cache.offset, mx.array)):
                    return _base.__call__(self, x, mask, cache)
                if how == "shared":
                    q, k, v = shared_pre(x, cache.offset, *self._decode_leaves)
                else:
                    q, k, v = self._decode_pre(x, cache.offset)
                k, v = cache.update_and_fetch(k, v)
                out = scaled_dot_product_attention(
                    q, k, v, cache=cache, scale=self.self_attn.scale, mask=mask
                )
                if how == "shared":
                    return shared_post(x, out, *self._decode_leaves)
                return self._decode_post(x, out)

            subclasses[base] = type(f"CompiledDecode{base.__name__}", (base,), {"__call__": call})
        layer.__class__ = subclasses[base]
    return len(layers)


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
            MODE["how"] = variant
            began = time.perf_counter()
            one_rep(gen, prompts, 8)
            print(f"rows {rows:3d} warm-up {variant}: {1000 * (time.perf_counter() - began):.0f} ms"
                  " (8 tokens, first use of this batch size)", flush=True)
        for rep in range(ns.reps):
            order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
            got = {}
            for variant in order:
                MODE["how"] = variant
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
