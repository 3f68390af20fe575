"""Offline builder for a tiny random-weight MLX model directory.

Owns the test fixture model: ``build_tiny_model`` writes ``config.json``,
``model.safetensors`` (seeded random weights), a byte-level BPE
``tokenizer.json`` trained on an embedded corpus, and a Qwen3-style
``tokenizer_config.json`` chat template, so that ``mlx_lm.load(path)`` loads
it like any Hugging Face MLX model. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pathlib
import random
import sys
from collections.abc import Iterable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

ARCH_CLASSES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ARCHS = ("qwen3", "llama", "qwen2")  # llama: tensor parallel; qwen2: both modes

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.start == 1 -%}"
    "{{- render_content(messages[0].content) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- elif ns.start == 1 -%}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + render_content(message.content)"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{%- set text = render_content(message.content) -%}"
    "{{- '<|im_start|>assistant\\n' + text -}}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' -}}'
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
    "{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content)"
    " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def training_corpus() -> list[str]:
    """A few hundred varied English lines, identical on every call."""
    rng = random.Random(1234)
    names = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent", "Peggy"]
    cities = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo"]
    weather = ["sunny", "rainy", "cloudy", "windy", "snowy", "foggy", "warm", "cold"]
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    greetings = ["Hello", "Hi", "Good morning", "Good evening", "Hey there", "Welcome"]
    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "I think, therefore I am.",
        "Please answer the question in one short sentence.",
        "You are a helpful assistant.",
        "Let me think about that step by step.",
    ]
    for _ in range(60):
        lines.append(f"{rng.choice(greetings)}, {rng.choice(names)}! How are you today?")
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"{a} {op} {b} = {result}")
        city = rng.choice(cities)
        lines.append(
            f"The weather in {city} is {rng.choice(weather)} and "
            f"{rng.randint(-5, 35)} degrees on {rng.choice(days)}."
        )
        lines.append(f"It is {rng.randint(1, 12)}:{rng.randint(0, 59):02d} in {city} right now.")
        args = json.dumps({"city": city, "unit": rng.choice(["celsius", "fahrenheit"])})
        lines.append(f'{{"name": "get_weather", "arguments": {args}}}')
        lines.append(f"{rng.choice(names)} asked what time it is in {rng.choice(cities)}.")
    return lines


def train_bpe_tokenizer(
    vocab_target: int, special_tokens: Sequence[str], corpus: Iterable[str]
) -> Tokenizer:
    """A byte-level BPE tokenizer trained offline on ``corpus``, with ``special_tokens``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def _build_tokenizer(vocab_target: int) -> Tokenizer:
    return train_bpe_tokenizer(vocab_target, SPECIAL_TOKENS, training_corpus())


def _model_config(arch: str, hidden_size: int, num_layers: int, vocab_size: int, eos_id: int):
    num_heads, num_kv_heads = 4, 2
    return {
        "architectures": [ARCH_CLASSES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
    }


def write_tokenizer_config(
    out: pathlib.Path,
    chat_template: str,
    *,
    eos: str = "<|im_end|>",
    bos: str | None = None,
    model_max_length: int = 2048,
) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for a tokenizer saved
    as ``tokenizer.json`` in ``out``: a fast tokenizer with ``chat_template``."""
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"eos_token": eos, "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def build_tiny_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    arch: str = "qwen3",
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_target: int = 512,
    weight_scale: float = 4.0,
) -> pathlib.Path:
    """Write a tiny random model that ``mlx_lm.load`` accepts into ``path``.

    Weights depend only on ``seed`` and the shape arguments; the tokenizer
    depends only on ``vocab_target``. Rebuilding over an existing dir is fine.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(vocab_target)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    tokenizer.save(str(out / "tokenizer.json"))

    config = _model_config(arch, hidden_size, num_layers, vocab_size, eos_id)
    arch_module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = arch_module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = arch_module.Model(args)
    # Default initialisation makes a tiny model repeat one token forever;
    # scaled-up projections give varied (still meaningless) text, which the
    # batching and caching tests need to tell sequences apart.
    weights = {
        k: v * weight_scale if ("proj" in k or "embed" in k) else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    # The index lets mlx-lm's sharded_load pick each pipeline stage's files.
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {k: "model.safetensors" for k in sorted(weights)},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_config(out, CHAT_TEMPLATE)
    logger.info("built tiny %s model (vocab %d, seed %d) at %s", arch, vocab_size, seed, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight MLX model.")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    ns = parser.parse_args(argv)
    sys.stdout.write(f"{build_tiny_model(ns.out_dir, seed=ns.seed, arch=ns.arch)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
