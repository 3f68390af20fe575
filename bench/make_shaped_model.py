"""Random-weight models with the shapes of real ones, for GPU benchmarks.

``python bench/make_shaped_model.py SHAPE OUT_DIR`` writes a model directory
that ``mlx_lm.load`` reads: the tiny test model's tokenizer and chat template
(ids past its small vocabulary decode as "!"), and bf16 random weights with
the layer sizes of SHAPE (``qwen3-0.6b``, ``llama3-8b``, ``llama3-8b-qwen2`` for pipeline
runs, ``llama3-8b-narrow`` and ``qwen3-moe-narrow`` for host-overhead profiles on a CPU, or
``test`` for a smoke run).
Compute per token matches the real model (but the narrow one's); the text is noise.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

SHAPES = {
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    # mlx-lm 0.32's llama can be tensor-sharded but not pipelined: for pipeline
    # runs, the same shape as a qwen2 (which also adds q/k/v biases).
    "llama3-8b-qwen2": dict(
        model_type="qwen2", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    # The 8B's structure (32 llama layers, GQA 4:1, untied head) at a tiny width:
    # per-layer Python as on the 8B, little compute; for host-overhead profiles on a CPU.
    "llama3-8b-narrow": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=32, intermediate_size=224,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=32768, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    # A mixture-of-experts layer stack (48 qwen3_moe layers, 32 experts, 8 a token, as a
    # Qwen3-30B-A3B has 48 layers and 8 of 128 experts a token) at a tiny width: the
    # per-layer Python of an MoE model on a CPU (bench/compiled_decode.py).
    "qwen3-moe-narrow": dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=48, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=32,
        num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=32, norm_topk_prob=True, vocab_size=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    "test": dict(
        model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=4096,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}


def make_shaped_model(
    shape: str, out: Path, seed: int = 0, dtype: str = "bfloat16", context: int | None = None
) -> Path:
    """``context``: the context window (the config's ``max_position_embeddings`` and the
    tokenizer's ``model_max_length``); by default the shape's and the tiny tokenizer's."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    from runtime.tiny_model import build_tiny_model

    config = dict(SHAPES[shape])
    if context is not None:
        config["max_position_embeddings"] = context
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tok")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tiny / name, out / name)
        eos = json.loads((tiny / "config.json").read_text())["eos_token_id"]
    if context is not None:
        tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
        tokenizer_config["model_max_length"] = context
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config["eos_token_id"] = eos
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: (p * 1.0).astype(getattr(mx, dtype)), model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {  # sharded_load reads it to pick a pipeline stage's files
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {k: "model.safetensors" for k in sorted(weights)},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--dtype", default="bfloat16", help="of the weights (the CPU: float32 is much faster)"
    )
    parser.add_argument(
        "--context", type=int, default=None,
        help="context window in tokens (config and tokenizer; default: the shape's "
        "max_position_embeddings, the tokenizer's 2048)",
    )
    args = parser.parse_args()
    print(make_shaped_model(args.shape, args.out, dtype=args.dtype, context=args.context))


if __name__ == "__main__":
    main()
