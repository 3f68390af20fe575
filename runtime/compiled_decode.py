"""A compiled decode path for mlx-lm's llama / qwen2 / qwen3 / qwen3_moe decoder layers.

Owns ``install_compiled_decode(model)``: it receives a loaded mlx-lm model
(on the engine's thread, before its first step) and gives each decoder layer
of a known kind a decode step through two ``mx.compile``d functions: the
layer before its KV cache (input norm, q/k/v projections, q/k norms, RoPE at
the cache's offsets) and the layer after its attention (output projection,
residual, norm, MLP or mixture of experts, residual). The KV-cache update and the attention stay as
mlx-lm has them, so what changes shape every step (the cache's length) never
enters a compiled function. It emits nothing; it returns how many layers took
the path.

Why: at a small batch the decode step is host-bound (docs/performance.md):
each of a layer's ~30 operations is built from Python and dispatched one by
one. Compiled, a layer is two calls and MLX fuses the element-wise work, so
the step takes less of the host (on this repo's CPU, a 32-layer narrow model
at batch 1: 0.70x the step time; the same greedy tokens).

A layer takes the compiled path only for a decode step (one token per row)
on a batch KV cache (its offsets an array: mlx-lm's ``BatchKVCache``); a
prefill, a single-sequence cache (``stream_generate``: Python offsets, which a
trace would bake in) or any other call runs mlx-lm's own ``__call__``. All
layers with the same parameter shapes and settings (``_layout``) share one compiled pair, the layer's
weights passed in: one trace per batch size for the whole model, and no
weight held by a trace (each layer's list of its weights is taken at
installation: install once the weights are final). Layers whose
projections are not plain or quantized ``Linear`` (LoRA adapters, a tensor-
parallel shard with its collectives) keep mlx-lm's path. A compiled call that
raises (a layer variant these functions do not trace) is not a failed step:
the layer finishes uncompiled and the layers of its layout keep mlx-lm's path
from then on, with a warning in the log.

Relies on mlx-lm's layer layout (attribute names ``self_attn``,
``input_layernorm``, ``post_attention_layernorm``, ``mlp``, ``q_proj`` ...
``o_proj``, ``rope``, ``n_heads``, ``n_kv_heads``, ``scale``; qwen3's
``q_norm`` / ``k_norm``) and on its ``TransformerBlock.__call__`` computing
what ``_before_cache`` and ``_after_attention`` do around the cache;
``tests/test_compiled_decode.py`` compares the tokens with mlx-lm's own path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runtime.cuda_decode_attention import decode_attention, warm_masked_decode
from runtime.held_prefix import held_prefix

log = logging.getLogger(__name__)

DECODE_PATHS = ("compiled", "mlx")


def _projections(layer: Any, x: Any) -> tuple[Any, Any, Any]:
    """A decoder layer's queries, keys and values for ``x`` (rows, length, width), before
    RoPE: the input norm, the projections and qwen3's q / k norms, heads on axis 2."""
    attn = layer.self_attn
    rows, length, _ = x.shape
    h = layer.input_layernorm(x)
    queries = attn.q_proj(h).reshape(rows, length, attn.n_heads, -1)
    keys = attn.k_proj(h).reshape(rows, length, attn.n_kv_heads, -1)
    values = attn.v_proj(h).reshape(rows, length, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    return queries, keys, values


def _with_rope(layer: Any, queries: Any, keys: Any, values: Any, offset: Any):
    """Heads first (rows, heads, length, dim), RoPE at ``offset``, as the cache takes them."""
    queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
    rope = layer.self_attn.rope
    return rope(queries, offset=offset), rope(keys, offset=offset), values


def _before_cache(layer: Any, x: Any, offset: Any) -> tuple[Any, Any, Any]:
    """A decoder layer's decode step up to its KV cache: queries, keys, values."""
    return _with_rope(layer, *_projections(layer, x), offset)


def _after_attention(layer: Any, x: Any, attended: Any) -> Any:
    """A decoder layer's decode step from its attention's output to the layer's output."""
    rows, _, length, _ = attended.shape
    merged = attended.transpose(0, 2, 1, 3).reshape(rows, length, -1)
    h = x + layer.self_attn.o_proj(merged)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _mixed_before_cache(layer: Any, x: Any, decoding_offset: Any,
                        chunk_offset: Any) -> tuple[Any, ...]:
    """``_before_cache`` for a step's decoding rows and a prefill chunk at once. ``x``:
    all their tokens (tokens, width), first one per decoding row, then the chunk's
    prompts one after another (their counts read from the offsets' shapes). One norm and
    one set of projections over all of them, then each part's heads and RoPE at its own
    cache's offsets. Returns the decoding rows' queries, keys and values, then the
    chunk's."""
    rows, prompts = decoding_offset.shape[0], chunk_offset.shape[0]
    length = (x.shape[0] - rows) // prompts
    parts = _projections(layer, x[None])
    ours = [t[0, :rows].reshape(rows, 1, *t.shape[2:]) for t in parts]
    theirs = [t[0, rows:].reshape(prompts, length, *t.shape[2:]) for t in parts]
    return (*_with_rope(layer, *ours, decoding_offset), *_with_rope(layer, *theirs, chunk_offset))


def _mixed_after_attention(layer: Any, x: Any, decoding_attended: Any,
                           chunk_attended: Any) -> Any:
    """``_after_attention`` for the decoding rows and the chunk at once: one output
    projection and one MLP over all their tokens (``x`` as ``_mixed_before_cache``
    takes it); returns the layer's output in the same layout."""
    import mlx.core as mx

    merged = mx.concatenate([
        a.transpose(0, 2, 1, 3).reshape(a.shape[0] * a.shape[2], -1)
        for a in (decoding_attended, chunk_attended)
    ])
    h = x + layer.self_attn.o_proj(merged)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _block_classes() -> tuple[type, ...]:
    from mlx_lm.models import llama, qwen2, qwen3, qwen3_moe

    return (
        llama.TransformerBlock,
        qwen2.TransformerBlock,
        qwen3.TransformerBlock,
        qwen3_moe.Qwen3MoeDecoderLayer,
    )


def _plain_projections(layer: Any) -> bool:
    """Every projection a plain or quantized ``Linear`` (not LoRA, not a shard).

    A mixture-of-experts MLP (qwen3_moe's sparse block): its router a plain or
    quantized ``Linear``, its experts mlx-lm's ``SwitchLinear`` layers, and no
    sharding group (a sharded block sums over its group).
    """
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    plain, experts = (nn.Linear, nn.QuantizedLinear), (SwitchLinear, QuantizedSwitchLinear)
    attn, mlp = layer.self_attn, layer.mlp
    try:
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if hasattr(mlp, "switch_mlp"):
            if getattr(mlp, "sharding_group", None) is not None:
                return False
            projections.append(mlp.gate)
            switch = mlp.switch_mlp
            if not all(type(p) in experts
                       for p in (switch.gate_proj, switch.up_proj, switch.down_proj)):
                return False
        else:
            projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    except AttributeError:
        return False
    return all(type(p) in plain for p in projections)


class _SharedPair:
    """The two compiled functions of every layer with one layout (``_layout``).

    Each takes the layer's parameters as trailing inputs (in ``names``' order)
    and runs the pure layer code on ``template`` with them swapped in for the
    trace; a traced call swaps nothing.
    """

    def __init__(self, template: Any):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        self.template = template
        self.names = [name for name, _ in tree_flatten(template.parameters())]
        self.before_cache = mx.compile(self._with_weights(_before_cache, 2))
        self.after_attention = mx.compile(self._with_weights(_after_attention, 2))
        # A decode step and a prefill chunk in one pass (runtime.mixed_step).
        self.mixed_before_cache = mx.compile(self._with_weights(_mixed_before_cache, 3))
        self.mixed_after_attention = mx.compile(self._with_weights(_mixed_after_attention, 3))
        self.broken = False  # a compiled call raised: mlx-lm's path from then on
        # While the load-time check (runtime.compiled_decode_check) runs, a call that raises
        # is its finding: it logs the one warning, and ``failure`` keeps the error for it.
        self.quiet = False
        self.failure: Exception | None = None

    def give_up(self, error: Exception) -> None:
        if not self.broken:
            self.failure = error
            if not self.quiet:
                log.warning("the compiled decode path failed (%s: %s); the layers of its layout "
                            "decode as mlx-lm builds them from now on", type(error).__name__, error)
        self.broken = True

    def _with_weights(self, piece: Callable, inputs: int) -> Callable:
        """``piece(template, *args[:inputs])`` with ``args[inputs:]`` as the template's
        weights."""
        from mlx.utils import tree_unflatten

        template, names = self.template, self.names

        def run(*args):
            saved = template.parameters()
            weights = args[inputs:]
            template.update(tree_unflatten(list(zip(names, weights, strict=True))))
            try:
                return piece(template, *args[:inputs])
            finally:
                template.update(saved)

        return run


def _layout(layer: Any, parameters: list[tuple[str, Any]]) -> tuple:
    """What a trace of ``layer`` depends on: its parameters' names, shapes and types, and
    every submodule's scalar settings (RoPE base and scale, norms' eps, heads, top-k,
    quantization bits), which a trace bakes in: layers share a compiled pair only where
    all of these agree. ``parameters``: the layer's, flattened."""
    shapes = tuple((name, tuple(v.shape), v.dtype) for name, v in parameters)
    settings = tuple(
        (name, tuple(sorted(
            (key, value) for key, value in vars(module).items()
            if isinstance(value, int | float | bool | str)
        )))
        for name, module in layer.named_modules()
    )
    return shapes, settings


def install_compiled_decode(model: Any) -> int:
    """Give ``model``'s decoder layers of a known kind the compiled decode path.

    Returns how many layers took it (0: the model is as it was). Call it on the
    thread that steps the model, once the model's weights are final.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.base import scaled_dot_product_attention

    layers = getattr(model, "layers", None) or []
    known = _block_classes()
    pairs: dict[tuple, _SharedPair] = {}
    subclasses: dict[type, type] = {}
    installed = 0
    for layer in layers:
        base = type(layer)
        if base not in known or not _plain_projections(layer):
            continue
        parameters = tree_flatten(layer.parameters())
        layout = _layout(layer, parameters)
        if layout not in pairs:
            pairs[layout] = _SharedPair(layer)
        layer._compiled_decode = pairs[layout]
        layer._compiled_weights = [v for _, v in parameters]
        if base not in subclasses:
            subclasses[base] = _compiled_subclass(base, mx, scaled_dot_product_attention)
        layer.__class__ = subclasses[base]
        installed += 1
    if installed:
        log.info("compiled decode path on %d of %d layers", installed, len(layers))
    return installed


def compiled_layouts(model: Any) -> list[Any]:
    """One layer of each layout of ``model`` whose compiled pair still runs (none: the
    model decodes as mlx-lm builds it); ``layer._compiled_decode`` is the pair."""
    representatives: dict[int, Any] = {}
    for layer in getattr(model, "layers", None) or []:
        pair = getattr(layer, "_compiled_decode", None)
        if pair is not None and not pair.broken:
            representatives.setdefault(id(pair), layer)
    return list(representatives.values())


def trace_batch_sizes(model: Any, sizes: Any) -> int:
    """Trace, and run once, every compiled pair of ``model`` at each batch size in ``sizes``.

    A compiled function traces anew for every input shape it has not met, and a
    server's decode batch changes size with every arrival and finish; tracing the
    sizes it can meet at load moves that cost off the first steps that meet them.
    Runs on zeros (a batch of ``rows`` one-token rows at offset 0) on the calling
    thread's default stream; returns how many (pair, size) traces it made. At two rows
    it also builds the masked decode kernel for the layer's shapes where that route is
    installed (``warm_masked_decode``). Call it after ``install_compiled_decode``, on the
    thread that steps the model.
    """
    import mlx.core as mx

    traced = 0
    for layer in compiled_layouts(model):
        pair, weights = layer._compiled_decode, layer._compiled_weights
        norm_weight = layer.input_layernorm.weight
        for rows in sizes:
            x = mx.zeros((rows, 1, norm_weight.shape[0]), dtype=norm_weight.dtype)
            offset = mx.zeros((rows,), dtype=mx.int32)
            try:
                queries, keys, values = pair.before_cache(x, offset, *weights)
                mx.eval(pair.after_attention(x, queries, *weights), keys, values)
                if rows == 2:
                    warm_masked_decode(mx, queries, keys, values, scale=layer.self_attn.scale)
            except Exception as exc:  # as in a step: this layout keeps mlx-lm's path
                pair.give_up(exc)
                break
            traced += 1
    return traced


def trace_mixed_shapes(model: Any, sizes: Any, lengths: Any) -> int:
    """Trace, and run once, every compiled pair's mixed functions (a step's decode and a
    prefill chunk in one pass: ``runtime.mixed_step``) for ``sizes`` decoding rows beside
    one prompt's chunk of each of ``lengths`` tokens.

    As ``trace_batch_sizes`` does for the decode step: a first meeting with a shape costs
    a trace and, run, whatever MLX builds for it on first use, and a row joining or
    leaving the streams beside a long prefill meets a new one. Runs on zeros at offset 0
    on the calling thread's default stream; returns how many (pair, size, length) runs
    it made. A pair that raises is given up, as in a step.
    """
    import mlx.core as mx

    traced = 0
    for layer in compiled_layouts(model):
        pair, weights = layer._compiled_decode, layer._compiled_weights
        norm_weight = layer.input_layernorm.weight
        try:
            for rows in sizes:
                for length in lengths:
                    x = mx.zeros((rows + length, norm_weight.shape[0]), dtype=norm_weight.dtype)
                    offsets = (mx.zeros((rows,), dtype=mx.int32),
                               mx.zeros((1,), dtype=mx.int32))
                    parts = pair.mixed_before_cache(x, *offsets, *weights)
                    mx.eval(pair.mixed_after_attention(x, parts[0], parts[3], *weights),
                            *parts)
                    traced += 1
        except Exception as exc:  # the step's own trace (MixedStepModel) then turns mixing off
            log.warning("the mixed decode-and-chunk pass failed at load (%s: %s)",
                        type(exc).__name__, exc)
    return traced


def _compiled_subclass(base: type, mx: Any, attention: Callable) -> type:
    """``base`` with a ``__call__`` that takes the compiled path for a batched decode step."""

    def uncompiled(self, x, mask, cache):
        if held_prefix(cache) is not None:  # mlx-lm's attention would miss the prefix
            raise RuntimeError("a KV layer holding its rows' prefix once needs the compiled "
                               "decode path, and this layer's has failed")
        return base.__call__(self, x, mask, cache)

    def __call__(self, x, mask=None, cache=None):
        if x.shape[1] != 1 or cache is None or not isinstance(cache.offset, mx.array):
            return uncompiled(self, x, mask, cache)
        pair, weights = self._compiled_decode, self._compiled_weights
        if pair.broken:
            return uncompiled(self, x, mask, cache)
        try:
            queries, keys, values = pair.before_cache(x, cache.offset, *weights)
        except Exception as exc:  # a trace that fails: this step, and every later one, uncompiled
            pair.give_up(exc)
            return uncompiled(self, x, mask, cache)
        keys, values = cache.update_and_fetch(keys, values)
        scale = self.self_attn.scale
        attended = decode_attention(mx, queries, cache, scale=scale, mask=mask)
        if attended is None:
            attended = attention(queries, keys, values, cache=cache, scale=scale, mask=mask)
        try:
            return pair.after_attention(x, attended, *weights)
        except Exception as exc:  # the cache has this token: finish the layer uncompiled
            pair.give_up(exc)
            return _after_attention(self, x, attended)

    return type(f"CompiledDecode{base.__name__}", (base,), {"__call__": __call__})
