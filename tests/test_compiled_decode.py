"""The compiled decode path (runtime.compiled_decode) against mlx-lm's own layers.

Real mlx (CPU) on tiny models of each known architecture (qwen3_moe built here,
with a dense layer and an expert layer): a model with the
path installed must give the very tokens of the same model without it, through
mlx-lm's ``BatchGenerator`` (where it applies) and ``stream_generate`` (where
it must not), plain and quantized; layers it cannot take keep mlx-lm's path.
At load (``make_engine_core``) the path checks itself against mlx-lm's layers and
turns itself off where a planted change makes the two differ.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator

from runtime.compiled_decode import install_compiled_decode
from runtime.compiled_decode_check import check_compiled_decode
from runtime.tiny_model import ARCHS, build_tiny_model

PROMPTS = [[5, 9, 12, 40, 41, 7], [3, 3, 8], [17, 2, 99, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module", params=ARCHS)
def model_path(request, tmp_path_factory) -> str:
    arch = request.param
    return str(build_tiny_model(tmp_path_factory.mktemp(f"cd-{arch}") / arch, arch=arch))


def batch_tokens(model, prompts=PROMPTS, max_tokens: int = 12, **options) -> list[list[int]]:
    """Greedy tokens of ``prompts`` decoded together (one batch, rows of different lengths);
    ``options``: more ``BatchGenerator`` arguments (its ``stream``)."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8, **options)
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    left = set(uids)
    while left:
        for r in gen.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
    gen.close()
    return [out[u] for u in uids]


def count_calls(model) -> list[int]:
    """Count the compiled pieces' calls (wrapping each layer's shared pair once)."""
    calls = [0]
    for pair in {id(layer._compiled_decode): layer._compiled_decode for layer in model.layers}.values():
        inner = pair.after_attention

        def counted(*args, inner=inner):
            calls[0] += 1
            return inner(*args)

        pair.after_attention = counted
    return calls


def test_batched_decode_gives_mlx_lms_tokens(model_path):
    stock, _ = load(model_path)
    compiled, _ = load(model_path)
    assert install_compiled_decode(compiled) == len(compiled.layers)
    calls = count_calls(compiled)
    expected = batch_tokens(stock)
    assert batch_tokens(compiled) == expected
    assert all(len(t) == 12 for t in expected)
    # Every decode step ran every layer through the compiled pieces; prefill did not.
    assert calls[0] > 0 and calls[0] % len(compiled.layers) == 0
    # A new batch size (one row, then two) is a new trace and the same tokens.
    assert batch_tokens(compiled, PROMPTS[:1]) == batch_tokens(stock, PROMPTS[:1])
    assert batch_tokens(compiled, PROMPTS[1:]) == batch_tokens(stock, PROMPTS[1:])


def decode_logits(model) -> mx.array:
    """Two decode steps' logits over a batch KV cache (rows left-padded differently)."""
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache([2, 0]) for _ in model.layers]
    model(mx.array([[0, 0, 5, 9, 12, 40], [3, 3, 8, 1, 2, 7]]), cache=cache)
    first = model(mx.array([[4], [6]]), cache=cache)
    return mx.concatenate([first, model(mx.array([[11], [13]]), cache=cache)], axis=1)


def test_decode_logits_match_mlx_lms(model_path):
    stock, _ = load(model_path)
    compiled, _ = load(model_path)
    install_compiled_decode(compiled)
    calls = count_calls(compiled)
    expected, got = decode_logits(stock), decode_logits(compiled)
    assert calls[0] == 2 * len(compiled.layers)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-5)


def test_single_sequence_generation_keeps_mlx_lms_path(model_path):
    """stream_generate's KV cache has Python offsets: the layers run as mlx-lm builds them."""
    stock, tokenizer = load(model_path)
    compiled, _ = load(model_path)
    install_compiled_decode(compiled)
    calls = count_calls(compiled)

    def run(model):
        prompt = mx.array(PROMPTS[0])
        return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=10)]

    assert run(compiled) == run(stock)
    assert calls[0] == 0


def test_quantized_layers_take_the_path(tiny_model_path):
    stock, _ = load(tiny_model_path)
    compiled, _ = load(tiny_model_path)
    for model in (stock, compiled):
        nn.quantize(model, group_size=32, bits=8)
    assert install_compiled_decode(compiled) == len(compiled.layers)
    assert batch_tokens(compiled) == batch_tokens(stock)


def test_layers_with_adapters_keep_mlx_lms_path(tiny_model_path):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(tiny_model_path)
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 1.0, "dropout": 0.0})
    before = [type(layer) for layer in model.layers]
    # The last layer has LoRA projections: only the others take the path.
    assert install_compiled_decode(model) == len(model.layers) - 1
    assert type(model.layers[-1]) is before[-1]
    assert type(model.layers[0]) is not before[0]


def test_unknown_models_are_left_alone():
    class Block(nn.Module):
        def __call__(self, x, mask=None, cache=None):
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block(), Block()]

    model = Model()
    assert install_compiled_decode(model) == 0
    assert all(type(layer) is Block for layer in model.layers)


@pytest.mark.parametrize("piece", ["before_cache", "after_attention"])
def test_a_compiled_piece_that_raises_falls_back_to_mlx_lms_path(tiny_model_path, piece, caplog):
    """A failing compiled call is not a failed step: the same tokens, uncompiled from then on."""
    stock, _ = load(tiny_model_path)
    compiled, _ = load(tiny_model_path)
    install_compiled_decode(compiled)
    pair = compiled.layers[0]._compiled_decode
    calls = [0]

    def failing(*args):
        calls[0] += 1
        raise RuntimeError("cannot trace this layer")

    setattr(pair, piece, failing)
    with caplog.at_level("WARNING", logger="runtime.compiled_decode"):
        assert batch_tokens(compiled) == batch_tokens(stock)
    assert pair.broken
    assert calls[0] == 1  # given up at the first failure
    assert sum("compiled decode path failed" in r.getMessage() for r in caplog.records) == 1


def tiny_moe_model():
    """A random two-layer qwen3_moe model: layer 0 a dense MLP, layer 1 four experts (top 2)."""
    from mlx_lm.models import qwen3_moe

    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[0], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=128,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=512, norm_topk_prob=True,
    )
    mx.random.seed(3)
    model = qwen3_moe.Model(args)
    mx.eval(model.parameters())
    twin = qwen3_moe.Model(args)
    twin.update(model.parameters())
    return model, twin


def test_mixture_of_experts_layers_match_mlx_lms():
    stock, compiled = tiny_moe_model()
    assert install_compiled_decode(compiled) == 2
    # The dense layer and the expert layer have different layouts: a compiled pair each.
    assert compiled.layers[0]._compiled_decode is not compiled.layers[1]._compiled_decode
    calls = count_calls(compiled)
    np.testing.assert_allclose(
        np.array(decode_logits(compiled)), np.array(decode_logits(stock)), rtol=1e-5, atol=1e-5
    )
    assert calls[0] == 2 * len(compiled.layers)
    assert not any(layer._compiled_decode.broken for layer in compiled.layers)
    assert batch_tokens(compiled) == batch_tokens(stock)
    # The load-time check finds both layouts in agreement with mlx-lm's layers.
    assert check_compiled_decode(compiled, 128, max_rows=4)
    assert not any(layer._compiled_decode.broken for layer in compiled.layers)


def test_layers_that_differ_in_a_setting_get_their_own_trace(tiny_model_path):
    """A trace bakes in the template layer's RoPE base: a layer with another base must not share it."""
    stock, _ = load(tiny_model_path)
    compiled, _ = load(tiny_model_path)
    for model in (stock, compiled):
        model.layers[1].self_attn.rope.base = 500.0
    install_compiled_decode(compiled)
    assert compiled.layers[0]._compiled_decode is not compiled.layers[1]._compiled_decode
    np.testing.assert_allclose(
        np.array(decode_logits(compiled)), np.array(decode_logits(stock)), rtol=1e-5, atol=1e-5
    )


def test_batch_sizes_traced_at_load_are_not_traced_again(model_path, monkeypatch):
    """``trace_batch_sizes`` traces each layout once a size; a decode step at a traced size
    adds no trace (the same tokens), one at a size not traced adds one."""
    import runtime.compiled_decode as compiled_decode

    traces: list[int] = []
    before_cache = compiled_decode._before_cache

    def counted(layer, x, offset):  # runs only while MLX traces the compiled function
        traces.append(x.shape[0])
        return before_cache(layer, x, offset)

    monkeypatch.setattr(compiled_decode, "_before_cache", counted)
    stock, _ = load(model_path)
    compiled, _ = load(model_path)
    install_compiled_decode(compiled)
    layouts = len({id(layer._compiled_decode) for layer in compiled.layers})
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        assert compiled_decode.trace_batch_sizes(compiled, [1, 3]) == 2 * layouts
    assert sorted(traces) == [1] * layouts + [3] * layouts

    def tokens(model, prompts):
        return batch_tokens(model, prompts, max_tokens=6, stream=stream)

    assert tokens(compiled, PROMPTS) == tokens(stock, PROMPTS)  # three rows: traced
    assert len(traces) == 2 * layouts
    four = [*PROMPTS, [8, 8, 1]]
    assert tokens(compiled, four) == tokens(stock, four)  # four rows: a new trace
    assert traces[2 * layouts:] == [4] * layouts


# ---------------------------------------------------------------- the check at load


def engine_tokens(core, prompts=PROMPTS, max_tokens: int = 10) -> list[list[int]]:
    """Greedy tokens of ``prompts`` served together by ``core`` (an ``EngineCore``)."""
    from runtime.messages import SamplingParams, Submit

    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        core.handle_command(Submit(
            request_id=i, prompt=tuple(prompt), segments=(tuple(prompt),),
            segment_types=("user",), sampling=SamplingParams(), max_tokens=max_tokens))
    for _ in range(200):
        for event in core.step().tokens:
            out[event.request_id].append(event.token)
        if not core.has_work:
            return [out[i] for i in range(len(prompts))]
    raise AssertionError("the engine did not finish its requests")


def load_engine(path: str, **settings):
    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core

    return make_engine_core(ServerConfig(model=path, decode_concurrency=4, **settings), path)


@pytest.fixture(scope="module")
def mlx_path_tokens(tiny_model_path) -> list[list[int]]:
    """The tiny model's greedy tokens served with ``--decode-path mlx``."""
    return engine_tokens(load_engine(tiny_model_path, decode_path="mlx"))


def check_records(caplog, level: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "runtime.compiled_decode_check" and r.levelname == level]


def test_the_load_check_keeps_the_compiled_path_where_it_agrees(
        tiny_model_path, mlx_path_tokens, caplog):
    with caplog.at_level("INFO", logger="runtime.compiled_decode_check"):
        core = load_engine(tiny_model_path)
    model = core.handle.model
    assert not any(layer._compiled_decode.broken for layer in model.layers)
    [agreed] = check_records(caplog, "INFO")
    assert "qwen3.TransformerBlock" in agreed and "tolerance 0.0001" in agreed
    assert not check_records(caplog, "WARNING")
    calls = count_calls(model)
    assert engine_tokens(core) == mlx_path_tokens
    assert calls[0] > 0  # the decode steps ran through the compiled pieces


def position_off_by_one(before_cache):
    return lambda layer, x, offset: before_cache(layer, x, offset + 1)


def residual_scaled(after_attention):
    return lambda layer, x, attended: after_attention(layer, x, 1.01 * attended)


def raising(before_cache):
    def fail(layer, x, offset):
        raise RuntimeError("a layer this trace cannot follow")

    return fail


@pytest.mark.parametrize("piece, change", [
    ("_before_cache", position_off_by_one),
    ("_after_attention", residual_scaled),
    ("_before_cache", raising),
])
def test_the_load_check_turns_a_changed_compiled_step_off(
        tiny_model_path, mlx_path_tokens, monkeypatch, caplog, piece, change):
    """A compiled step that no longer computes mlx-lm's layer (planted through the pieces
    the pairs trace): at load the model goes back to mlx-lm's layers, with one warning,
    and serves the tokens of ``--decode-path mlx``."""
    import runtime.compiled_decode as compiled_decode

    monkeypatch.setattr(compiled_decode, piece, change(getattr(compiled_decode, piece)))
    with caplog.at_level("INFO"):
        core = load_engine(tiny_model_path)
    model = core.handle.model
    assert all(layer._compiled_decode.broken for layer in model.layers)
    [warning] = check_records(caplog, "WARNING")
    assert "qwen3.TransformerBlock" in warning and "mlx-lm builds it" in warning
    if change is raising:
        assert "raised (RuntimeError: a layer this trace cannot follow)" in warning
    else:
        assert "differs from mlx-lm's" in warning and "tolerance 0.0001" in warning
    # The check's own warning is the only one (the pairs' give_up stayed quiet), and the
    # load traced nothing for a path that is off.
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert not any("traced for batch sizes" in r.getMessage() for r in caplog.records)
    calls = count_calls(model)
    assert engine_tokens(core) == mlx_path_tokens
    assert calls[0] == 0  # every decode step ran mlx-lm's layers


def test_the_load_check_traces_only_sizes_the_load_traces(tiny_model_path, monkeypatch):
    """The check decodes at one row and at two (only one where the server decodes one):
    the same traces ``trace_batch_sizes`` then reuses, not new ones."""
    import runtime.compiled_decode as compiled_decode

    traces: list[int] = []
    before_cache = compiled_decode._before_cache

    def counted(layer, x, offset):  # runs only while MLX traces the compiled function
        traces.append(x.shape[0])
        return before_cache(layer, x, offset)

    monkeypatch.setattr(compiled_decode, "_before_cache", counted)
    single, _ = load(tiny_model_path)
    install_compiled_decode(single)
    assert check_compiled_decode(single, single.args.vocab_size, max_rows=1)
    assert traces == [1]
    model, _ = load(tiny_model_path)
    install_compiled_decode(model)
    traces.clear()
    assert check_compiled_decode(model, model.args.vocab_size, max_rows=8)
    assert sorted(traces) == [1, 2]
    assert compiled_decode.trace_batch_sizes(model, [1, 2, 3]) == 3
    assert sorted(traces) == [1, 2, 3]


def test_mixed_shapes_traced_at_load_are_not_traced_again(tiny_model_path, monkeypatch, caplog):
    """``trace_mixed_shapes`` traces and runs the mixed pair (a step's decode and a paced
    chunk in one pass) once a (rows, chunk length); the pass a step then makes at such a
    shape adds no trace, one at another shape adds one; a pair that raises is reported
    and counted out."""
    import runtime.compiled_decode as compiled_decode

    traces: list[tuple[int, int]] = []
    mixed_before_cache = compiled_decode._mixed_before_cache

    def counted(layer, x, decoding_offset, chunk_offset):  # runs only while MLX traces
        traces.append((decoding_offset.shape[0], x.shape[0] - decoding_offset.shape[0]))
        return mixed_before_cache(layer, x, decoding_offset, chunk_offset)

    monkeypatch.setattr(compiled_decode, "_mixed_before_cache", counted)
    model, _ = load(tiny_model_path)
    install_compiled_decode(model)
    layer = compiled_decode.compiled_layouts(model)[0]
    assert compiled_decode.trace_mixed_shapes(model, [2, 3], [64, 128]) == 4
    assert sorted(traces) == [(2, 64), (2, 128), (3, 64), (3, 128)]

    def step_pass(rows: int, length: int) -> None:
        pair, weights = layer._compiled_decode, layer._compiled_weights
        x = mx.ones((rows + length, layer.input_layernorm.weight.shape[0]))
        offsets = mx.array([5] * rows), mx.array([9])
        mx.eval(*pair.mixed_before_cache(x, *offsets, *weights))

    step_pass(3, 64)
    assert len(traces) == 4
    step_pass(4, 64)
    assert traces[4:] == [(4, 64)]

    def broken(*args):
        raise RuntimeError("planted")

    monkeypatch.setattr(layer._compiled_decode, "mixed_before_cache", broken)
    assert compiled_decode.trace_mixed_shapes(model, [2], [64]) == 0
    assert "planted" in caplog.text
