"""Vision-language models through mlx-vlm: which models, and a prompt's image inputs.

Owns the kernel's side of images in chat. ``vision_family(model_path)`` says
whether the model named at start-up is a vision-language model this server
serves with mlx-vlm (its ``config.json`` has a ``vision_config`` and a
``model_type`` in ``VISION_FAMILIES``). ``load_vision_processor`` loads its
mlx-vlm processor (the HTTP side's copy when the engine is a process).
``prepare_vision_prompt`` receives a rendered chat prompt and its decoded
images (``ImageInput``) and emits the prompt's token ids, with each image's
placeholder expanded to the image's patch count, and the image tensors
(``VisionInputs``, numpy arrays: picklable, so they cross to an engine
process inside ``Submit``), exactly as mlx-vlm's own ``prepare_inputs``
makes them for its ``generate``.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import attrs

log = logging.getLogger(__name__)

# Served through mlx-vlm and tested: the Qwen-VL family (same processor and
# chat-template conventions). Other mlx-vlm families load as text models.
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@attrs.frozen
class ImageInput:
    """One decoded image (an RGB PIL image) and the request part it came from."""

    param: str  # e.g. "messages[0].content[1]", for errors
    image: Any = attrs.field(eq=False, repr=False)


@attrs.frozen(eq=False)
class VisionInputs:
    """A prompt's image tensors as the model's ``get_input_embeddings`` takes them."""

    arrays: dict[str, Any]  # "pixel_values", "image_grid_thw", ... -> numpy arrays

    def as_mlx(self) -> dict[str, Any]:
        import mlx.core as mx

        return {name: mx.array(value) for name, value in self.arrays.items()}


def _config(model_path: str | pathlib.Path) -> dict:
    path = pathlib.Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def vision_family(model_path: str | pathlib.Path) -> str | None:
    """The model's ``model_type`` when it is a vision-language model served through
    mlx-vlm, else None (a text model, or a family not in ``VISION_FAMILIES``)."""
    config = _config(model_path)
    model_type = config.get("model_type")
    if not config.get("vision_config") or model_type not in VISION_FAMILIES:
        return None
    return model_type


def load_vision_processor(model_path: str, model_type: str) -> Any:
    """mlx-vlm's processor of the model (tokenizer, image processor, chat template)."""
    import importlib

    from mlx_vlm.utils import load_processor

    # Importing the family's module installs mlx-vlm's own processor class for it
    # (as mlx_vlm.load does), in place of the Hugging Face one that needs torch.
    importlib.import_module(f"mlx_vlm.models.{model_type}")
    return load_processor(pathlib.Path(model_path), add_detokenizer=True)


def prepare_vision_prompt(
    processor: Any, model_type: str, prompt: str, images: list[ImageInput]
) -> tuple[tuple[int, ...], VisionInputs]:
    """(token ids, image tensors) of a rendered prompt holding one placeholder per image."""
    import numpy as np
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    inputs = prepare_inputs(
        processor,
        images=[i.image for i in images],
        prompts=prompt,
        add_special_tokens=should_add_special_tokens(model_type, processor),
    )
    ids = tuple(int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1))
    arrays = {
        name: np.asarray(value)
        for name, value in inputs.items()
        if name not in ("input_ids", "attention_mask") and value is not None
    }
    return ids, VisionInputs(arrays)
