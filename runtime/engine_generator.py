"""The engine's ``BatchGenerator``: mlx-lm's, with the behaviours the server adds
to its steps.

Owns ``EngineBatchGenerator``, which ``runtime.batch_sampling.make_batch_generator``
builds: a prompt batch that steps aside for short prompts
(``runtime.short_prompts_first``) and steps whose prefill chunk goes before their
decode where that saves a forward pass (``runtime.mixed_step.ChunkGoesFirst``).
Receives and emits what mlx-lm's generator does.
"""

from __future__ import annotations

from runtime.mixed_step import ChunkGoesFirst
from runtime.short_prompts_first import ShortFirstGenerator


class EngineBatchGenerator(ChunkGoesFirst, ShortFirstGenerator):
    """mlx-lm's ``BatchGenerator`` with short prompts first and chunks first."""
