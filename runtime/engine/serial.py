"""Requests that cannot share a batch, behind the batch generator's interface.

Speculative decoding (a draft model), a quantized KV cache (``kv_bits``) and
models whose KV cache cannot be merged are served one request at a time by
mlx-lm's ``stream_generate``. ``SerialGenerator`` wraps it in the interface of
mlx-lm's ``BatchGenerator`` as ``EngineCore`` uses it (``insert_segments``,
``next``, ``remove``, ``extract_cache``, ``prompt_cache_nbytes``, ``close``),
so those requests take the engine's one path:

* ``insert_segments`` queues sequences (FIFO); nothing runs yet.
* ``next()`` serves the first sequence, one token per call (so an abort
  still lands between tokens): the first call of a sequence processes its
  prompt, reported as prompt responses (no segment ends: ``stream_generate``
  takes the prompt whole). A sequence that finishes comes back with its KV
  cache cut to exactly the tokens it holds, for the prompt cache. A failure
  raises ``SequenceError`` for that sequence alone.
* ``remove`` drops waiting sequences and stops the running one.

Runs on the engine thread, like the rest of MLX.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from runtime.config import ServerConfig
from runtime.engine.failures import SequenceError
from runtime.mlx_environment import PREFILL_STEP_SIZES

log = logging.getLogger(__name__)

# The server builds its generators from its settings (``runtime.engine.loading``).
# Built without them (the tests), a generator prefills in mlx-lm's 2048-token
# steps, and drafts and groups the quantized KV cache as the settings' defaults
# say, which are mlx_lm.server's: mlx-lm's functions have defaults of their own
# (``speculative_generate_step`` drafts 2 tokens and prefills 512 at a time).
# ``quantized_kv_start`` (0: quantize from the first token) and ``max_tokens``
# (``BatchGenerator``'s) are the generator's own.
_SETTINGS = attrs.fields(ServerConfig)


@attrs.frozen
class PromptResponse:
    """Like mlx-lm's ``PromptProcessingBatch.Response``."""

    uid: int
    progress: tuple[int, int]  # (prompt tokens processed, all), cached ones included
    end_of_segment: bool
    end_of_prompt: bool


@attrs.frozen
class GenerationResponse:
    """Like mlx-lm's ``GenerationBatch.Response``."""

    uid: int
    token: int
    logprobs: Any
    finish_reason: str | None  # "stop", "length" or None, as mlx-lm says it
    prompt_cache: list | None  # when finished: the cache, holding exactly ``all_tokens``
    all_tokens: list[int] | None


@attrs.define
class _Sequence:
    uid: int
    prompt: list[int]  # the tokens still to process
    all_tokens: list[int]  # those the given cache holds
    cache: list | None
    max_tokens: int
    sampler: Any
    logits_processors: list
    num_draft_tokens: int | None


@attrs.define
class _Run:
    sequence: _Sequence
    responses: Iterator[Any]
    cache: list
    tokens: list[int]  # all the tokens fed to the model or generated so far


class SerialGenerator:
    """mlx-lm's ``stream_generate`` with ``BatchGenerator``'s interface: one sequence at a time."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        draft_model: Any = None,
        stream: Any = None,
        prefill_step_size: int = PREFILL_STEP_SIZES["gpu"],
        num_draft_tokens: int = _SETTINGS.num_draft_tokens.default,
        kv_bits: int | None = _SETTINGS.kv_bits.default,
        kv_group_size: int = _SETTINGS.kv_group_size.default,
        quantized_kv_start: int = 0,
        max_tokens: int = 128,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        self.stream = stream
        self.prefill_step_size = prefill_step_size
        self.num_draft_tokens = num_draft_tokens
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.quantized_kv_start = quantized_kv_start
        self.max_tokens = max_tokens
        self._uid_count = 0
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._run: _Run | None = None
        self._progress: list[PromptResponse] = []

    # ------------------------------------------------------------- inserting

    def insert_segments(
        self,
        segments: list[list[list[int]]],
        max_tokens: list[int] | None = None,
        caches: list[list | None] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Callable | None] | None = None,
        logits_processors: list[list] | None = None,
        stop_sequences: list | None = None,
        num_draft_tokens: list[int | None] | None = None,
    ) -> list[int]:
        """Queue one sequence per entry of ``segments``; returns their uids.

        ``stop_sequences`` is accepted and not used: ``stream_generate`` stops
        at the tokenizer's end-of-sequence tokens, the stop the engine gives.
        ``num_draft_tokens`` (speculative decoding): None means the generator's.
        """
        n = len(segments)
        options = {
            "max_tokens": max_tokens or [self.max_tokens] * n,
            "caches": caches or [None] * n,
            "all_tokens": all_tokens or [[] for _ in range(n)],
            "samplers": samplers or [None] * n,
            "logits_processors": logits_processors or [[] for _ in range(n)],
            "stop_sequences": stop_sequences or [None] * n,
            "num_draft_tokens": num_draft_tokens or [None] * n,
        }
        for name, values in options.items():
            if len(values) != n:
                raise ValueError(f"Option {name} must have one entry per segment")
        new = []
        for i, sequence_segments in enumerate(segments):
            uid = self._uid_count + i
            prompt = [t for segment in sequence_segments for t in segment]
            if not prompt:
                raise ValueError(f"Sequence {uid} has an empty prompt.")
            if options["max_tokens"][i] <= 0:
                raise ValueError(f"Sequence {uid}'s max_tokens must be > 0.")
            new.append(
                _Sequence(
                    uid=uid,
                    prompt=prompt,
                    all_tokens=list(options["all_tokens"][i]),
                    cache=options["caches"][i],
                    max_tokens=options["max_tokens"][i],
                    sampler=options["samplers"][i],
                    logits_processors=options["logits_processors"][i] or [],
                    num_draft_tokens=options["num_draft_tokens"][i],
                )
            )
        self._waiting.extend(new)
        self._uid_count += n
        return [s.uid for s in new]

    # --------------------------------------------------------------- stepping

    def next(self) -> tuple[list[PromptResponse], list[GenerationResponse]]:
        """One token of the sequence being served (starting the next one if none is)."""
        if self._run is None:
            if not self._waiting:
                return [], []
            sequence = self._waiting.popleft()
            try:
                self._run = self._start(sequence)
            except Exception as exc:
                raise SequenceError(sequence.uid, str(exc)) from exc
        run = self._run
        uid = run.sequence.uid
        try:
            response = next(run.responses)
        except Exception as exc:
            self._run = None
            self._progress.clear()
            raise SequenceError(uid, str(exc) or type(exc).__name__) from exc
        prompts, self._progress = self._progress, []
        token = int(response.token)
        run.tokens.append(token)
        cache = tokens = None
        if response.finish_reason is not None:
            self._run = None
            cache, tokens = _cut_to_common_length(run.cache, run.tokens)
        return prompts, [
            GenerationResponse(
                uid=uid,
                token=token,
                logprobs=response.logprobs,
                finish_reason=response.finish_reason,
                prompt_cache=cache,
                all_tokens=tokens,
            )
        ]

    def _start(self, sequence: _Sequence) -> _Run:
        from mlx_lm.generate import stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        cache = sequence.cache
        if cache is None:
            cache = make_prompt_cache(self.model)
            if self.draft_model is not None:
                cache += make_prompt_cache(self.draft_model)
        cached = len(sequence.all_tokens)

        def report(done: int, total: int) -> None:
            self._progress.append(
                PromptResponse(
                    uid=sequence.uid,
                    progress=(cached + done, cached + total),
                    end_of_segment=done == total,
                    end_of_prompt=done == total,
                )
            )

        kwargs: dict[str, Any] = dict(
            sampler=sequence.sampler,
            logits_processors=sequence.logits_processors,
            prompt_cache=cache,
            prefill_step_size=self.prefill_step_size,
        )
        if self.draft_model is not None:
            kwargs["num_draft_tokens"] = sequence.num_draft_tokens or self.num_draft_tokens
        else:
            kwargs["prompt_progress_callback"] = report
        if self.kv_bits is not None:
            kwargs.update(
                kv_bits=self.kv_bits,
                kv_group_size=self.kv_group_size,
                quantized_kv_start=self.quantized_kv_start,
            )
        if self.stream is not None:
            kwargs["stream"] = self.stream
        responses = stream_generate(
            self.model,
            self.tokenizer,
            sequence.prompt,
            max_tokens=sequence.max_tokens,
            draft_model=self.draft_model,
            **kwargs,
        )
        return _Run(
            sequence=sequence,
            responses=responses,
            cache=cache,
            tokens=sequence.all_tokens + sequence.prompt,
        )

    # ----------------------------------------------------------- the rest

    def remove(self, uids, return_prompt_caches: bool = False) -> dict:
        """Drop waiting sequences and stop the one being served, if named."""
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        gone = set(uids)
        self._waiting = collections.deque(s for s in self._waiting if s.uid not in gone)
        if self._run is not None and self._run.sequence.uid in gone:
            self._stop_run()
        return caches

    def extract_cache(self, uids) -> dict[int, tuple[list, list[int]]]:
        """(cache, tokens it holds) of the named waiting sequences that brought a cache.

        The sequence being served is left out: ``stream_generate`` is writing
        its cache, and the engine asks only at segment ends, which this
        generator never reports.
        """
        wanted = set(uids)
        return {
            s.uid: (s.cache, list(s.all_tokens))
            for s in self._waiting
            if s.uid in wanted and s.cache is not None
        }

    @property
    def prompt_cache_nbytes(self) -> int:
        caches = [s.cache for s in self._waiting if s.cache is not None]
        if self._run is not None:
            caches.append(self._run.cache)
        return sum(c.nbytes for cache in caches for c in cache)

    def close(self) -> None:
        self._waiting.clear()
        self._stop_run()

    def _stop_run(self) -> None:
        run, self._run = self._run, None
        self._progress.clear()
        if run is not None:
            close = getattr(run.responses, "close", None)
            if close is not None:
                close()


def _cut_to_common_length(cache: list, tokens: list[int]) -> tuple[list | None, list[int] | None]:
    """A finished sequence's cache and exactly the tokens it holds, or (None, None).

    ``stream_generate`` may or may not have fed the last token, and with a
    draft model the draft's cache can be a token apart from the model's: cut
    every layer to the shortest (None if one cannot be cut), and key the entry
    by that many tokens.
    """
    offsets = [getattr(c, "offset", None) for c in cache]
    if not cache or any(o is None for o in offsets):
        return None, None
    held = min(min(offsets), len(tokens))
    for c, offset in zip(cache, offsets, strict=True):
        if offset > held:
            if not (hasattr(c, "is_trimmable") and c.is_trimmable()):
                return None, None
            c.trim(offset - held)
    if held <= 0:
        return None, None
    return cache, tokens[:held]
