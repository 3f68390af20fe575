"""Tests for runtime.tiny_model: the offline tiny MLX model fixture."""

import mlx_lm
import pytest
from mlx_lm.tool_parsers import json_tools

from runtime.tiny_model import SPECIAL_TOKENS, build_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Weather in "},
            {"type": "text", "text": "Paris?"},
        ],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
            },
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    model, tokenizer = mlx_lm.load(str(path))
    return path, model, tokenizer


def test_load_and_inferred_features(loaded):
    path, _, tokenizer = loaded
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file()
    assert tokenizer.has_thinking
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_parser is json_tools.parse_tool_call
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tokenizer.eos_token_ids
    assert type(tokenizer._detokenizer).__name__ == "BPEStreamingDetokenizer"
    vocab = tokenizer.get_vocab()
    assert all(tok in vocab for tok in SPECIAL_TOKENS)
    # Each special token is one id, never split by BPE.
    for tok in SPECIAL_TOKENS:
        assert tokenizer.encode(tok, add_special_tokens=False) == [vocab[tok]]


def test_vocab_matches_model(loaded):
    _, model, tokenizer = loaded
    assert model.args.vocab_size == len(tokenizer)


def test_chat_template_tools_and_roles(loaded):
    _, _, tokenizer = loaded
    ids = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n")
    assert "<tools>\n" in text and '"name": "get_weather"' in text and "</tools>" in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
        "<|im_end|>\n"
    ) in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<think>" not in text


def test_chat_template_thinking_switch(loaded):
    _, _, tokenizer = loaded
    msgs = [{"role": "user", "content": "hi"}]
    off = tokenizer.decode(
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    )
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    on = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_system_without_tools(loaded):
    _, _, tokenizer = loaded
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


@pytest.mark.parametrize(
    "s",
    ["hello world", "3 + 4 = 7", "  spaced\n\ttabs  ", '{"city": "Paris"}', "héllo wörld ✓ 日本"],
)
def test_round_trip(loaded, s):
    _, _, tokenizer = loaded
    assert tokenizer.decode(tokenizer.encode(s)) == s


def test_streaming_detokenizer(loaded):
    _, _, tokenizer = loaded
    s = "héllo wörld ✓ 日本"
    detok = tokenizer.detokenizer
    detok.reset()
    for tok in tokenizer.encode(s):
        detok.add_token(tok)
    detok.finalize()
    assert detok.text == s


def test_generate_greedy(loaded):
    _, model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True
    )
    out1 = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=8)
    out2 = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=8)
    assert isinstance(out1, str)
    assert out1 == out2


def test_deterministic_and_idempotent(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    before = (a / "model.safetensors").read_bytes()
    assert build_tiny_model(a, seed=3) == a
    assert (a / "model.safetensors").read_bytes() == before


def test_llama_arch(tmp_path):
    path = build_tiny_model(tmp_path / "llama", arch="llama", seed=1)
    model, tokenizer = mlx_lm.load(str(path))
    assert model.model_type == "llama"
    assert tokenizer.has_tool_calling and tokenizer.has_thinking
    assert isinstance(mlx_lm.generate(model, tokenizer, prompt="Hello", max_tokens=8), str)


def test_bad_arch(tmp_path):
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "x", arch="gpt2")
