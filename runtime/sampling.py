"""Per-request samplers and logits processors, built on the engine thread.

Receives a ``SamplingParams``; returns what mlx-lm's ``BatchGenerator`` takes
per sequence. Unseeded requests use mlx-lm's ``make_sampler`` unchanged
(greedy requests share one sampler object, so the batch samples them in one
call). A ``seed`` gets its own random key that advances once per step, so a
seeded request stays in the batch and is reproducible regardless of what else
runs beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    make_logits_processors,
    make_sampler,
)

from runtime.messages import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def build_sampler(params: SamplingParams, xtc_special_tokens: list[int]) -> Sampler | None:
    """``None`` means the batch's shared greedy sampler."""
    if params.is_greedy:
        return None
    if params.seed is None:
        return make_sampler(
            params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            xtc_probability=params.xtc_probability,
            xtc_threshold=params.xtc_threshold,
            xtc_special_tokens=xtc_special_tokens,
        )
    return _seeded_sampler(params, xtc_special_tokens)


def _seeded_sampler(params: SamplingParams, xtc_special_tokens: list[int]) -> Sampler:
    key = mx.random.key(params.seed)
    inverse_temperature = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        if 0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p != 0.0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.xtc_probability > 0.0:
            # mlx-lm's XTC draws from the thread's global key: seeded requests
            # that also ask for XTC are reproducible only when served alone.
            logprobs = apply_xtc(
                logprobs, params.xtc_probability, params.xtc_threshold, xtc_special_tokens
            )
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        return mx.random.categorical(logprobs * inverse_temperature, key=draw)

    return sample


def build_logits_processors(params: SamplingParams) -> list:
    return make_logits_processors(
        dict(params.logit_bias) if params.logit_bias else None,
        params.repetition_penalty,
        params.repetition_context_size,
        params.presence_penalty,
        params.presence_context_size,
        params.frequency_penalty,
        params.frequency_context_size,
    )
