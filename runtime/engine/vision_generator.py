"""A vision-language model's requests, one at a time, through mlx-vlm's ``generate_step``.

``VisionGenerator`` is ``SerialGenerator`` (the batch generator's interface,
one sequence at a time, one token per ``next()``) with mlx-vlm in place of
mlx-lm's ``stream_generate``: each sequence's prompt goes in whole with its
image tensors (``insert_segments(vision_inputs=...)``, a
``runtime.vision.VisionInputs`` or None for a text-only prompt), through the
model's ``get_input_embeddings`` as mlx-vlm's own ``generate`` does, so a
request's tokens are the ones ``mlx_vlm.generate`` gives for the same prompt,
images and sampler. mlx-vlm generates per request, so a vision-language model
is served on this serial path only. A finished sequence leaves no prompt-cache
entry: image placeholders are the same tokens whatever the pixels, so a
cached prefix could belong to another image.

Runs on the engine thread, like the rest of MLX.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import attrs

from runtime.engine.serial import SerialGenerator, _Run, _Sequence

log = logging.getLogger(__name__)


@attrs.frozen
class _Token:
    token: int
    logprobs: Any
    finish_reason: str | None


class VisionGenerator(SerialGenerator):
    """``SerialGenerator`` over mlx-vlm: prompts with images, one sequence at a time."""

    def __init__(self, model: Any, tokenizer: Any, **options: Any):
        super().__init__(model, tokenizer, **options)
        self._vision: dict[int, Any] = {}  # uid -> VisionInputs (or None), until it starts

    def insert_segments(self, segments, *args, vision_inputs: list | None = None, **kwargs) -> list[int]:
        uids = super().insert_segments(segments, *args, **kwargs)
        for uid, vision in zip(uids, vision_inputs or [None] * len(uids), strict=True):
            self._vision[uid] = vision
        return uids

    def remove(self, uids, return_prompt_caches: bool = False) -> dict:
        for uid in uids:
            self._vision.pop(uid, None)
        return super().remove(uids, return_prompt_caches)

    def close(self) -> None:
        self._vision.clear()
        super().close()

    def _start(self, sequence: _Sequence) -> _Run:
        import mlx.core as mx

        vision = self._vision.pop(sequence.uid, None)
        if sequence.cache is not None or sequence.all_tokens:
            raise ValueError("a vision-language model's sequence cannot start from a cached prefix")
        extra = vision.as_mlx() if vision is not None else {}
        pixel_values = extra.pop("pixel_values", None)
        input_ids = mx.array(sequence.prompt)[None]
        total = len(sequence.prompt)
        responses = self._tokens(sequence, input_ids, pixel_values, extra)
        self._progress.append(_prompt_started(sequence.uid, total))
        # An empty cache list: ``next()`` hands no cache back (see the module docstring).
        return _Run(sequence=sequence, responses=responses, cache=[], tokens=list(sequence.prompt))

    def _tokens(self, sequence: _Sequence, input_ids, pixel_values, extra: dict) -> Iterator[_Token]:
        import mlx.core as mx
        from mlx_vlm.generate import generate_step

        eos = set(self.tokenizer.eos_token_ids)
        steps = generate_step(
            input_ids,
            self.model,
            pixel_values,
            mx.ones_like(input_ids),
            max_tokens=sequence.max_tokens,
            sampler=sequence.sampler,
            logits_processors=sequence.logits_processors or None,
            prefill_step_size=self.prefill_step_size,
            **extra,
        )
        produced = 0
        for token, logprobs in steps:  # mlx-vlm computes on its own thread-local stream
            produced += 1
            token = int(token)
            if token in eos:
                yield _Token(token, logprobs, "stop")
                return
            if produced >= sequence.max_tokens:
                yield _Token(token, logprobs, "length")
                return
            yield _Token(token, logprobs, None)


def _prompt_started(uid: int, total: int):
    from runtime.engine.serial import PromptResponse

    return PromptResponse(uid=uid, progress=(total, total), end_of_segment=True, end_of_prompt=True)
