"""A tiny scripted chat model whose greedy output is fixed: a tool call, then an answer.

For end-to-end tests with real agent clients (tests/test_agent_clis.py): the
model must call one of the client's own tools, whatever the client's 20 k
token prompt says, and answer in text once the tool's result is back.

How: a one-layer Qwen3 whose attention and MLP outputs are zero, so the
hidden state at a position is the embedding of its token alone. Tokens of
the script get orthonormal embeddings and the LM head maps each to its
successor, so greedy decoding follows a fixed chain. The chat template ends
the generation prompt with ``<|call|>`` (when tools are offered and no tool
result is in the conversation yet) or ``<|answer|>``; the chains are

    <|call|>   -> <tool_call> -> CALL -> </tool_call> -> <|im_end|>
    <|answer|> -> ANSWER -> <|im_end|>

where CALL and ANSWER are added (non-special) tokens whose text is the whole
JSON call and the whole answer. A byte-level BPE of 8 k tokens trained on
this project's docs and some standard-library source keeps a client's
prompt near 4 characters a token; the context is 128 k positions.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from runtime.tiny_model import train_bpe_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
           "<|call|>", "<|answer|>"]

CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}{{- part.text or '' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(tool=false) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- set ns.tool = true -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + render(message.content)"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' + render(message.content) -}}"
    "{%- for tool_call in message.tool_calls -%}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.function.name + \'", "arguments": \''
    " + (tool_call.function.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{{- '<|answer|>' if ns.tool or not tools else '<|call|>' -}}"
    "{%- endif -%}"
)


def _corpus() -> list[str]:
    """English and code text found on every machine: this project's docs, some stdlib source."""
    root = pathlib.Path(__file__).resolve().parents[1]
    files = sorted((root / "docs").glob("*.md")) + [root / "README.md"]
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files += [stdlib / name for name in ("argparse.py", "subprocess.py", "typing.py", "shutil.py",
                                         "json/encoder.py", "pathlib.py", "logging/__init__.py")]
    lines = []
    for f in files:
        if f.exists():
            lines += f.read_text(errors="replace").splitlines()
    return lines


def build_scripted_model(
    path: str | pathlib.Path,
    *,
    call: dict,
    answer: str,
    vocab_target: int = 8192,
    hidden_size: int = 32,
) -> pathlib.Path:
    """Write the model: its tool call is ``call`` (``{"name", "arguments"}``), its answer ``answer``."""
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    call_text = "\n" + json.dumps(call) + "\n"

    tokenizer = train_bpe_tokenizer(vocab_target, SPECIAL, _corpus())
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (call_text, answer)])
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in [*SPECIAL, call_text, answer]}
    chain = [("<|call|>", "<tool_call>"), ("<tool_call>", call_text), (call_text, "</tool_call>"),
             ("</tool_call>", "<|im_end|>"), ("<|answer|>", answer), (answer, "<|im_end|>")]

    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "num_hidden_layers": 1,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": hidden_size // 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": ids["<|im_end|>"],
    }
    from mlx_lm.models import qwen3

    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    rng = np.random.default_rng(0)
    sources = [ids[a] for a, _ in chain]
    basis, _ = np.linalg.qr(rng.normal(size=(hidden_size, hidden_size)))
    embed = rng.normal(size=(vocab_size, hidden_size)).astype(np.float32)
    head = np.zeros((vocab_size, hidden_size), dtype=np.float32)
    for k, (a, b) in enumerate(chain):
        embed[ids[a]] = basis[k] * np.sqrt(hidden_size)
        head[ids[b]] += 10.0 * basis[k]
    assert len(set(sources)) == len(sources) <= hidden_size
    weights["model.embed_tokens.weight"] = mx.array(embed)
    weights["lm_head.weight"] = mx.array(head)
    for name in list(weights):
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "tool_parser_type": "json_tools",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out
