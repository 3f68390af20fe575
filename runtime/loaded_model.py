"""A loaded model as the engine holds it: not a message.

``LoadedModel`` is built where the model is loaded (``runtime.engine.loading``,
on the thread or in the process that steps it) and is mutable: the engine
drops ``model`` on its way out, on the thread that made its arrays. The trio
side never holds the engine's copy: the ModelLoader keeps one without the
model (``for_trio_side``) for the Sessions it leases, which need the
tokenizer; what crosses an actor boundary about a model is its frozen
``ModelInfo`` (``runtime.lifecycle``).
"""

from __future__ import annotations

import attrs

from runtime.lifecycle import ModelInfo


@attrs.define(kw_only=True)
class LoadedModel:
    """The weights (engine only), the tokenizer (shared), and what the model is (``info``)."""

    model: object | None
    tokenizer: object
    info: ModelInfo
    # a vision model's mlx-vlm processor (images -> tensors), shared like the tokenizer
    processor: object | None = None

    def for_trio_side(self) -> LoadedModel:
        """A copy without the weights: what Sessions lease (the engine keeps the model)."""
        return attrs.evolve(self, model=None)
