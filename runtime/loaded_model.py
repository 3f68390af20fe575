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
    """The weights (engine only), the tokenizer (shared), and what the model is."""

    model: object | None
    tokenizer: object
    model_key: str
    vocab_size: int
    batchable: bool = True
    kv_bytes_per_token: int = 0  # K and V, all layers: the admission estimate's unit
    kv_budget: int = 0  # bytes of KV cache the Scheduler may admit (0: no limit)
    engine_pid: int | None = None  # the process that runs the engine (None: this one)
    ranks: int = 1  # distributed: how many processes share the model
    parallel: str | None = None  # distributed: "tensor" or "pipeline"
    context_window: int | None = None  # most tokens a sequence may hold (None: unknown)
    vision_family: str | None = None  # a vision-language model's model_type (runtime.vision)
    processor: object | None = None  # its mlx-vlm processor (images -> tensors), shared like the tokenizer

    @property
    def info(self) -> ModelInfo:
        """What the model is, as a message."""
        return ModelInfo(
            model_key=self.model_key,
            vocab_size=self.vocab_size,
            batchable=self.batchable,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_budget=self.kv_budget,
            engine_pid=self.engine_pid,
            ranks=self.ranks,
            parallel=self.parallel,
            context_window=self.context_window,
            vision_family=self.vision_family,
        )

    def for_trio_side(self) -> LoadedModel:
        """A copy without the weights: what Sessions lease (the engine keeps the model)."""
        return attrs.evolve(self, model=None)
