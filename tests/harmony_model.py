"""Tiny gpt-oss (Harmony) models built offline: a random one and a scripted one.

``build_tiny_gpt_oss`` writes a random-weight ``gpt_oss`` model (mlx-lm's
architecture at toy sizes) with a byte-level BPE tokenizer that has Harmony's
special tokens, and ``HARMONY_TEMPLATE``, a small chat template in Harmony
form: system and developer messages with tools, user turns, assistant turns
(analysis and final channels), assistant tool calls, tool results and the
``reasoning_effort`` variable, shaped as gpt-oss's own template reads them.

``build_scripted_gpt_oss`` writes a model whose greedy output is fixed, as
tests/scripted_model.py does for Qwen3 (attention and expert outputs zero, so
each position's hidden state is its token's embedding; the LM head maps each
token of the script to its successor). The template ends the generation
prompt with a trigger token, ``<|think|>`` while tools are offered and no
tool result is in the conversation, ``<|answer|>`` otherwise, and the chains
are

    <|think|>  -> <|channel|> -> analysis -> <|message|> -> THOUGHTS -> <|end|>
               -> <|start|> -> CALL_HEADER -> ARGS_1 -> ARGS_2 -> <|call|>
    <|answer|> -> FINAL_HEADER -> ANSWER -> <|return|>

where CALL_HEADER is one added token whose text is
``assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>``,
FINAL_HEADER one whose text is ``<|channel|>final<|message|>`` (each token of
a chain must be new in it), THOUGHTS and ANSWER added tokens holding the
whole texts, and ARGS_1, ARGS_2 the two halves of the call's JSON arguments. The decoded output is plain Harmony.
"""

from __future__ import annotations

import json
import pathlib

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from runtime.tiny_model import train_bpe_tokenizer, training_corpus, write_tokenizer_config

HARMONY_SPECIAL = ["<|endoftext|>", "<|startoftext|>", "<|start|>", "<|end|>", "<|message|>",
                   "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TRIGGERS = ["<|think|>", "<|answer|>"]

GENERATION_PROMPT = "{{- '<|start|>assistant' -}}"
SCRIPTED_GENERATION_PROMPT = (
    "{{- '<|start|>assistant' + ('<|think|>' if tools and not ns.tool_result else '<|answer|>') -}}"
)

HARMONY_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}{{- part.text or '' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(instructions='', last_tool='', tool_result=false) -%}"
    "{%- for message in messages if message.role in ('system', 'developer') -%}"
    "{%- set ns.instructions = ns.instructions + render(message.content) -%}"
    "{%- endfor -%}"
    "{{- '<|start|>system<|message|>You are a tiny test model.\\nReasoning: ' -}}"
    "{{- reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -}}"
    "{{- '\\n\\n# Valid channels: analysis, commentary, final.' -}}"
    "{%- if tools -%}"
    "{{- ' Calls to these tools must go to the commentary channel: \\'functions\\'.' -}}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- if ns.instructions or tools -%}"
    "{{- '<|start|>developer<|message|>' -}}"
    "{%- if ns.instructions -%}{{- '# Instructions\\n\\n' + ns.instructions + '\\n\\n' -}}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{- '\\n// ' + (fn.description or '') + '\\ntype ' + fn.name + ' = (_: ' -}}"
    "{{- (fn.parameters or {}) | tojson -}}"
    "{{- ') => any;\\n' -}}"
    "{%- endfor -%}"
    "{{- '\\n} // namespace functions' -}}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}"
    "{{- '<|start|>user<|message|>' + render(message.content) + '<|end|>' -}}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{%- if message.thinking -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- set call = message.tool_calls[0] -%}"
    "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
    "{%- set ns.last_tool = call.name -%}"
    "{{- '<|start|>assistant to=functions.' + call.name -}}"
    "{{- '<|channel|>commentary <|constrain|>json<|message|>' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}"
    "{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}"
    "{{- '<|call|>' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if message.thinking and loop.last and not add_generation_prompt -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' -}}"
    "{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + render(message.content) + '<|end|>' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- set ns.tool_result = true -%}"
    "{{- '<|start|>functions.' + ns.last_tool + ' to=assistant<|channel|>commentary<|message|>' -}}"
    "{{- render(message.content) | tojson -}}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + GENERATION_PROMPT + "{%- endif -%}"
)


def _tokenizer(extra_special: list[str] = ()):
    tokenizer = train_bpe_tokenizer(512, HARMONY_SPECIAL + list(extra_special), training_corpus())
    return tokenizer


def _config(vocab_size: int, eos_id: int, hidden_size: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "sliding_window": 128,
        "rope_theta": 150000,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
    }


def _write(out: pathlib.Path, tokenizer, config: dict, weights: dict, template: str) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_config(out, template, eos="<|return|>", bos="<|startoftext|>",
                           model_max_length=4096)


def _random_weights(config: dict, seed: int) -> tuple[object, dict]:
    from mlx_lm.models import gpt_oss

    mx.random.seed(seed)
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    return model, weights


def build_tiny_gpt_oss(path, *, seed: int = 0, hidden_size: int = 64) -> pathlib.Path:
    """A random-weight gpt_oss model with a Harmony tokenizer and chat template."""
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    config = _config(tokenizer.get_vocab_size(with_added_tokens=True),
                     tokenizer.token_to_id("<|return|>"), hidden_size)
    _, weights = _random_weights(config, seed)
    _write(out, tokenizer, config, weights, HARMONY_TEMPLATE)
    return out


def build_scripted_gpt_oss(
    path, *, thoughts: str, call: dict, answer: str, hidden_size: int = 64
) -> pathlib.Path:
    """A gpt_oss model whose greedy reply is ``thoughts`` then the tool call ``call``
    (``{"name", "arguments"}``) while no tool result is in the conversation, and the
    final ``answer`` after one."""
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(TRIGGERS)
    call_header = (f"assistant to=functions.{call['name']}<|channel|>commentary "
                   "<|constrain|>json<|message|>")
    final_header = "<|channel|>final<|message|>"
    arguments = json.dumps(call["arguments"])
    half = len(arguments) // 2  # two tokens: the call streams in parts
    texts = ["analysis", thoughts, call_header, arguments[:half], arguments[half:], final_header,
             answer]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in texts])
    ids = {t: tokenizer.token_to_id(t) for t in HARMONY_SPECIAL + TRIGGERS + texts}
    chain = ["<|think|>", "<|channel|>", "analysis", "<|message|>", thoughts, "<|end|>",
             "<|start|>", call_header, arguments[:half], arguments[half:], "<|call|>"]
    answer_chain = ["<|answer|>", final_header, answer, "<|return|>"]
    edges = list(zip(chain, chain[1:], strict=False))
    edges += list(zip(answer_chain, answer_chain[1:], strict=False))

    config = _config(tokenizer.get_vocab_size(with_added_tokens=True),
                     ids["<|return|>"], hidden_size)
    _, weights = _random_weights(config, 0)
    vocab_size = config["vocab_size"]
    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.normal(size=(hidden_size, hidden_size)))
    embed = rng.normal(size=(vocab_size, hidden_size)).astype(np.float32)
    head = np.zeros((vocab_size, hidden_size), dtype=np.float32)
    sources = [ids[a] for a, _ in edges]
    assert len(set(sources)) == len(sources) <= hidden_size
    for k, (a, b) in enumerate(edges):
        embed[ids[a]] = basis[k] * np.sqrt(hidden_size)
        head[ids[b]] += 10.0 * basis[k]
    weights["model.embed_tokens.weight"] = mx.array(embed)
    weights["lm_head.weight"] = mx.array(head)
    for name in list(weights):
        if ".o_proj." in name or ".down_proj." in name:  # weights and biases
            weights[name] = mx.zeros_like(weights[name])
    template = HARMONY_TEMPLATE.replace(GENERATION_PROMPT, SCRIPTED_GENERATION_PROMPT)
    _write(out, tokenizer, config, weights, template)
    return out
