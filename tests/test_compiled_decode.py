"""The compiled decode path (runtime.compiled_decode) against mlx-lm's own layers.

Real mlx (CPU) on tiny models of each known architecture (qwen3_moe built here,
with a dense layer and an expert layer): a model with the
path installed must give the very tokens of the same model without it, through
mlx-lm's ``BatchGenerator`` (where it applies) and ``stream_generate`` (where
it must not), plain and quantized; layers it cannot take keep mlx-lm's path.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator

from runtime.compiled_decode import install_compiled_decode
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
