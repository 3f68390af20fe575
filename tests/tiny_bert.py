"""A tiny random BERT embedding model built offline, for the embeddings tests.

``build_tiny_bert(path, seed)`` writes what ``mlx_embeddings.load`` reads:
``config.json`` (model_type ``bert``: hidden 64, 2 layers), ``model.safetensors``
(seeded random weights, saved with mlx from the model's own parameter tree) and
a WordPiece ``tokenizer.json`` (trained here with ``tokenizers`` on a small
embedded corpus, with BERT's ``[CLS] ... [SEP]`` post-processor) plus its
``tokenizer_config.json``. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_POSITIONS = 64
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "embeddings map text to vectors of numbers",
    "a server answers requests from many clients at once",
    "batching puts several inputs through the model in one pass",
    "the weather in oslo is cold and snowy today",
    "what time is it in paris and in tokyo",
    "numbers such as one two three four five six seven eight nine ten",
]


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIAL)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tokenizer


def build_tiny_bert(path: Path, *, seed: int = 0) -> Path:
    """Write the model directory at ``path`` (made if missing); returns ``path``."""
    from mlx_embeddings.models import bert

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
        "sep_token": "[SEP]", "mask_token": "[MASK]",
        "model_max_length": MAX_POSITIONS, "padding_side": "right",
    }, indent=2) + "\n")
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": MAX_POSITIONS,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": tokenizer.token_to_id("[PAD]"),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model = bert.Model(bert.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = tree_map(lambda p: mx.random.normal(p.shape, scale=0.2), model.parameters())
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(params)))
    return path
