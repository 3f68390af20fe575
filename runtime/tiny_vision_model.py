"""Offline builder for a tiny random-weight Qwen2-VL model directory.

Owns the vision-language test fixture: ``build_tiny_vision_model`` writes
``config.json`` (a tiny text and vision config), ``model.safetensors``
(seeded random weights in the layout ``mlx_vlm.load`` expects), a byte-level
BPE ``tokenizer.json`` with Qwen's vision tokens (``<|vision_start|>``,
``<|image_pad|>``, ``<|vision_end|>``), a Qwen2-VL-style chat template and a
``preprocessor_config.json``, so that ``mlx_vlm.load(path)`` and its
processor work with nothing downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.tiny_model import (
    SPECIAL_TOKENS,
    train_bpe_tokenizer,
    training_corpus,
    write_tokenizer_config,
)

logger = logging.getLogger(__name__)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE = 14
MERGE_SIZE = 2
# Images are resized to between one and sixteen merged patches (28 x 28 pixels each).
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2
MAX_PIXELS = 16 * MIN_PIXELS

VISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _config(hidden_size: int, num_layers: int, vocab_size: int, ids: dict[str, int]) -> dict:
    num_heads = 4
    head_dim = hidden_size // num_heads
    quarter = head_dim // 4
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        # mrope: (temporal, height, width) sections, twice their sum is the head dim
        "rope_scaling": {"type": "mrope", "mrope_section": [quarter, quarter, head_dim // 2 - 2 * quarter]},
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
            "patch_size": PATCH_SIZE,
            "spatial_patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": 2,
        },
    }


def build_tiny_vision_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_target: int = 512,
    weight_scale: float = 4.0,
) -> pathlib.Path:
    """Write a tiny random Qwen2-VL that ``mlx_vlm.load`` accepts into ``path``."""
    from mlx_vlm.models import qwen2_vl

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(vocab_target, SPECIAL_TOKENS + VISION_TOKENS, training_corpus())
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + VISION_TOKENS}
    tokenizer.save(str(out / "tokenizer.json"))

    config = _config(hidden_size, num_layers, vocab_size, ids)
    model_config = qwen2_vl.ModelConfig.from_dict(dict(config))
    model_config.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = qwen2_vl.TextConfig.from_dict(model_config.text_config)
    mx.random.seed(seed)
    model = qwen2_vl.Model(model_config)
    # As runtime.tiny_model: scaled-up projections give varied text, not one token repeated.
    weights = {
        k: v * weight_scale if ("proj" in k or "embed" in k) else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    write_tokenizer_config(out, VISION_CHAT_TEMPLATE)
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": VISION_CHAT_TEMPLATE}, indent=2) + "\n"
    )
    logger.info("built tiny qwen2_vl model (vocab %d, seed %d) at %s", vocab_size, seed, out)
    return out
