"""Deterministic test doubles for the engine and the detokenizer.

* ``FakeBatchGenerator``: mlx-lm's ``BatchGenerator`` as ``runtime.engine.core.EngineCore``
  uses it, replaying scripted tokens (a function of each sequence's prompt) and
  recording every call, so tests can assert what entered and left the batch
  (its signatures are mlx-lm's: tests/test_generator_signatures.py).
* ``FakeBatchGeneratorFactory``: the ``batch_generator_factory`` EngineCore takes;
  keeps every generator it made (EngineCore makes a new one after a failed step).
* ``FakePromptCache``: the ``PromptCacheStore`` methods EngineCore calls (mlx-lm's
  ``LRUPromptCache`` ones and ``has_entry`` / ``remove_entry``); never hits,
  evicts only when told (``remove_entry``), as the real store does.
* ``FakeTokenizer``: what ``DetokenizerCore`` and ``make_text_state_machine`` read
  from mlx-lm's ``TokenizerWrapper``, over a fixed id -> bytes table in which
  some tokens are partial multi-byte UTF-8 pieces.

No MLX is needed by any of them.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# ------------------------------------------------------------ batch generator


@dataclass
class FakePromptResponse:
    """Like ``PromptProcessingBatch.Response``."""

    uid: int
    progress: tuple[int, int]
    end_of_segment: bool
    end_of_prompt: bool


@dataclass
class FakeGenerationResponse:
    """Like ``GenerationBatch.Response``."""

    uid: int
    token: int
    logprobs: Any
    finish_reason: str | None
    prompt_cache: list | None
    all_tokens: list[int] | None


@dataclass
class FakeKVCache:
    """Stands in for one layer's KV cache: remembers the tokens it covers."""

    tokens: tuple[int, ...]
    bytes_per_token: int = 16

    @property
    def nbytes(self) -> int:
        return len(self.tokens) * self.bytes_per_token

    def is_trimmable(self) -> bool:  # what mlx-lm's can_trim_prompt_cache asks
        return True

    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        self.tokens = self.tokens[: len(self.tokens) - n]
        return n


@dataclass
class FakeSequence:
    uid: int
    segments: list[list[int]]
    prompt: list[int]  # all_tokens (cached prefix) + the segments
    max_tokens: int
    sampler: Any = None
    logits_processors: Any = None
    stop_sequences: Any = None
    generated: list[int] = field(default_factory=list)
    next_segment: int = 0  # segments before this one have been processed
    cached: int = 0  # len(all_tokens) at insertion


@dataclass
class StepRecord:
    """What one ``next()`` call did."""

    index: int  # 1-based, counting next() calls of this generator
    active_before: tuple[int, ...]  # uids decoding, then uids waiting, at entry
    prompt_uids: tuple[int, ...]  # prompts processed in this step
    generated: tuple[tuple[int, int, str | None], ...]  # (uid, token, finish_reason)

    @property
    def uids(self) -> set[int]:
        return set(self.prompt_uids) | {uid for uid, _, _ in self.generated}


def scripted_token(prompt: Sequence[int], i: int, vocab: int) -> int:
    """The fake's i-th (0-based) generated token for ``prompt``."""
    return (sum(prompt) + 7 * i) % vocab


class FakeBatchGenerator:
    """Replays ``scripted_token`` deterministically, one token per sequence per step.

    A sequence enters the batch when a slot is free (at most
    ``completion_batch_size`` sequences are in it; the rest wait in FIFO order)
    and its prompt is processed in that step: one prompt response with
    ``end_of_segment=end_of_prompt=True``, or with ``per_segment=True`` one
    segment per step, one response each (``end_of_prompt`` on the last), as
    mlx-lm does at segment boundaries, so EngineCore saves the segment caches.
    From the next step on it yields one token per step and finishes with
    "stop" on an ``eos_ids`` token or with "length" at its ``max_tokens``.
    ``fail_on_step=N`` makes the N-th ``next()`` raise ``RuntimeError`` (its message
    ``failure``, where given).
    """

    def __init__(
        self,
        *,
        vocab: int = 512,
        eos_ids: Iterable[int] = (),
        completion_batch_size: int = 4,
        fail_on_step: int | None = None,
        failure: str | None = None,
        per_segment: bool = False,
        bytes_per_token: int = 16,
        emit_logprobs: bool = False,
    ):
        if completion_batch_size <= 0:
            raise ValueError("completion_batch_size must be > 0")
        self.vocab = vocab
        self.eos_ids = frozenset(eos_ids)
        self.completion_batch_size = completion_batch_size
        self.fail_on_step = fail_on_step
        self.failure = failure
        self.per_segment = per_segment
        self.bytes_per_token = bytes_per_token
        self.emit_logprobs = emit_logprobs
        self._uid_count = 0
        self._waiting: collections.deque[FakeSequence] = collections.deque()
        self._active: dict[int, FakeSequence] = {}  # uid -> sequence, insertion ordered
        # records
        self.sequences: dict[int, FakeSequence] = {}  # every uid ever inserted
        self.inserted: list[int] = []
        self.removed: list[int] = []
        self.remove_calls: list[tuple[int, ...]] = []
        self.extracted: list[tuple[int, ...]] = []
        self.finished: dict[int, str] = {}  # uid -> finish reason
        self.steps: list[StepRecord] = []
        self.next_calls = 0
        self.closed = False
        self.calls: list[tuple[str, Any]] = []

    # ------------------------------------------------------------- inserting

    def insert_segments(
        self,
        segments,
        max_tokens=None,
        caches=None,
        all_tokens=None,
        samplers=None,
        logits_processors=None,
        stop_sequences=None,
    ) -> list[int]:
        self._check_open()
        n = len(segments)
        max_tokens = max_tokens or [128] * n
        caches = caches or [None] * n
        all_tokens = all_tokens or [[] for _ in range(n)]
        samplers = samplers or [None] * n
        logits_processors = logits_processors or [[] for _ in range(n)]
        stop_sequences = stop_sequences or [None] * n
        for name, value in (
            ("max_tokens", max_tokens),
            ("caches", caches),
            ("all_tokens", all_tokens),
            ("samplers", samplers),
            ("logits_processors", logits_processors),
            ("stop_sequences", stop_sequences),
        ):
            if len(value) != n:
                raise ValueError(f"Option {name} must have one entry per segment")
        new = []
        for segs, m, at, s, lp, ss in zip(
            segments,
            max_tokens,
            all_tokens,
            samplers,
            logits_processors,
            stop_sequences,
            strict=True,
        ):
            segs = [list(seg) for seg in segs if len(seg)]
            if not segs:
                raise ValueError("empty prompt")
            if m <= 0:
                raise ValueError("max_tokens must be > 0")
            uid = self._uid_count + len(new)
            prompt = list(at) + [t for seg in segs for t in seg]
            new.append(FakeSequence(uid, segs, prompt, m, s, lp, ss, cached=len(at)))
        uids = [seq.uid for seq in new]
        self._uid_count += n
        for seq in new:
            self.sequences[seq.uid] = seq
            self._waiting.append(seq)
        self.inserted.extend(uids)
        self.calls.append(("insert_segments", tuple(uids)))
        return uids

    # --------------------------------------------------------------- stepping

    def next(self):
        self._check_open()
        self.next_calls += 1
        self.calls.append(("next", self.next_calls))
        if self.fail_on_step is not None and self.next_calls == self.fail_on_step:
            raise RuntimeError(self.failure or f"injected failure on step {self.next_calls}")
        active_before = tuple(self._active) + tuple(s.uid for s in self._waiting)

        # Decode first, as BatchGenerator does: one token per decoding sequence.
        generation: list[FakeGenerationResponse] = []
        for seq in list(self._active.values()):
            if seq.next_segment < len(seq.segments):
                continue  # still in its prompt
            i = len(seq.generated)
            token = scripted_token(seq.prompt, i, self.vocab)
            seq.generated.append(token)
            reason = None
            if token in self.eos_ids:
                reason = "stop"
            elif len(seq.generated) >= seq.max_tokens:
                reason = "length"
            cache = all_tokens = None
            if reason is not None:
                del self._active[seq.uid]
                self.finished[seq.uid] = reason
                all_tokens = seq.prompt + seq.generated
                cache = [FakeKVCache(tuple(all_tokens), self.bytes_per_token)]
            generation.append(
                FakeGenerationResponse(
                    uid=seq.uid,
                    token=token,
                    logprobs=self._logprobs(token) if self.emit_logprobs else None,
                    finish_reason=reason,
                    prompt_cache=cache,
                    all_tokens=all_tokens,
                )
            )

        # Fill free slots from the FIFO, then advance every prompt: all of it in
        # one step, or (per_segment) one segment per step.
        while self._waiting and len(self._active) < self.completion_batch_size:
            seq = self._waiting.popleft()
            self._active[seq.uid] = seq
        prompts: list[FakePromptResponse] = []
        for seq in self._active.values():
            if seq.next_segment >= len(seq.segments):
                continue
            total = sum(len(s) for s in seq.segments)
            stop = seq.next_segment + 1 if self.per_segment else len(seq.segments)
            seq.next_segment = stop
            done = sum(len(s) for s in seq.segments[:stop])
            last = stop == len(seq.segments)
            prompts.append(FakePromptResponse(seq.uid, (done, total), True, last))

        self.steps.append(
            StepRecord(
                index=self.next_calls,
                active_before=active_before,
                prompt_uids=tuple(p.uid for p in prompts),
                generated=tuple((g.uid, g.token, g.finish_reason) for g in generation),
            )
        )
        return prompts, generation

    def _logprobs(self, token: int):
        import mlx.core as mx

        logits = mx.zeros((self.vocab,))
        logits[token] = 5.0
        return logits - mx.logsumexp(logits)

    # ----------------------------------------------------------- the rest

    def remove(self, uids, return_prompt_caches=False):
        self._check_open()
        uids = tuple(uids)
        self.remove_calls.append(uids)
        self.calls.append(("remove", uids))
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        gone = set(uids)
        for uid in uids:
            if uid in self._active or any(s.uid == uid for s in self._waiting):
                self.removed.append(uid)
        self._waiting = collections.deque(s for s in self._waiting if s.uid not in gone)
        for uid in gone:
            self._active.pop(uid, None)
        return caches

    def extract_cache(self, uids) -> dict[int, tuple[list, list[int]]]:
        self.extracted.append(tuple(uids))
        self.calls.append(("extract_cache", tuple(uids)))
        out = {}
        for uid in uids:
            seq = self._active.get(uid) or next((s for s in self._waiting if s.uid == uid), None)
            if seq is not None:
                # The tokens the sequence's cache covers so far.
                done = seq.cached + sum(len(x) for x in seq.segments[: seq.next_segment])
                tokens = seq.prompt[:done] + seq.generated
                out[uid] = ([FakeKVCache(tuple(tokens), self.bytes_per_token)], tokens)
        return out

    @property
    def prompt_cache_nbytes(self) -> int:
        seqs = list(self._active.values()) + list(self._waiting)
        return sum((len(s.prompt) + len(s.generated)) * self.bytes_per_token for s in seqs)

    @property
    def active_uids(self) -> set[int]:
        """Uids in the batch or waiting for it."""
        return set(self._active) | {s.uid for s in self._waiting}

    def close(self) -> None:
        self.closed = True
        self.calls.append(("close", None))

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the batch generator is closed")

    # -------------------------------------------------------------- queries

    def steps_after(self, call_index: int) -> list[StepRecord]:
        """The steps recorded after ``self.calls[call_index]``."""
        later = {n for name, n in self.calls[call_index + 1 :] if name == "next"}
        return [s for s in self.steps if s.index in later]

    def expected_tokens(self, uid: int) -> list[int]:
        """What the sequence ``uid`` generates if left to finish."""
        seq = self.sequences[uid]
        out = []
        for i in range(seq.max_tokens):
            token = scripted_token(seq.prompt, i, self.vocab)
            out.append(token)
            if token in self.eos_ids:
                break
        return out


class FakeBatchGeneratorFactory:
    """``batch_generator_factory`` for EngineCore; keeps every generator made.

    ``fail_on_step`` is either one step number (for the first generator only)
    or a sequence with one entry per generator made (None: never fails).
    """

    def __init__(self, *, fail_on_step: int | Sequence[int | None] | None = None, **kwargs):
        if fail_on_step is None or isinstance(fail_on_step, int):
            fail_on_step = [fail_on_step]
        self._fail = list(fail_on_step)
        self._kwargs = kwargs
        self.instances: list[FakeBatchGenerator] = []

    def __call__(self) -> FakeBatchGenerator:
        n = len(self.instances)
        fail = self._fail[n] if n < len(self._fail) else None
        gen = FakeBatchGenerator(fail_on_step=fail, **self._kwargs)
        self.instances.append(gen)
        return gen

    @property
    def current(self) -> FakeBatchGenerator:
        return self.instances[-1]


# ----------------------------------------------------------------- prompt cache


class FakePromptCache:
    """``PromptCacheStore`` as EngineCore uses it; lookups always miss."""

    def __init__(self) -> None:
        self.entries: dict[tuple[Any, tuple[int, ...]], tuple[list, str]] = {}
        self.inserts: list[tuple[Any, tuple[int, ...], str]] = []
        self.fetches: list[tuple[Any, tuple[int, ...]]] = []
        self.removals: list[tuple[Any, tuple[int, ...]]] = []

    def fetch_nearest_cache(self, model, tokens):
        self.fetches.append((model, tuple(tokens)))
        return None, list(tokens)

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type: str = "assistant"):
        key = (model, tuple(tokens))
        self.inserts.append((model, tuple(tokens), cache_type))
        self.entries[key] = (prompt_cache, cache_type)

    def has_entry(self, model, tokens) -> bool:
        return (model, tuple(tokens)) in self.entries

    def remove_entry(self, model, tokens) -> int | None:
        self.removals.append((model, tuple(tokens)))
        entry = self.entries.pop((model, tuple(tokens)), None)
        return None if entry is None else sum(c.nbytes for c in entry[0])

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for cache, _ in self.entries.values() for c in cache)


# -------------------------------------------------------------------- tokenizer

# id -> bytes. Ids 0-4 are the markup/special tokens; 17-23 are pieces of
# multi-byte UTF-8 characters ("é" = c3 a9, "日" = e6 97 a5, "😀" = f0 9f 98 80)
# that decode only once the whole character is in; 29 merges a marker's closing
# ">" with the next byte, as some BPE vocabularies do.
FAKE_VOCAB: tuple[bytes, ...] = (
    b"<eos>",  # 0
    b"<think>",  # 1
    b"</think>",  # 2
    b"<tool_call>",  # 3
    b"</tool_call>",  # 4
    b"a",  # 5
    b"b",  # 6
    b" ",  # 7
    b"\n",  # 8
    b"hello",  # 9
    b" world",  # 10
    b"{",  # 11
    b"}",  # 12
    b'"',  # 13
    b":",  # 14
    b"<",  # 15
    b">",  # 16
    b"\xc3",  # 17
    b"\xa9",  # 18
    b"\xe6",  # 19
    b"\x97\xa5",  # 20
    b"\xf0\x9f",  # 21
    b"\x98",  # 22
    b"\x80",  # 23
    "日".encode(),  # 24
    b"x",  # 25
    b"1",  # 26
    b",",  # 27
    b"ab",  # 28
    b">\n",  # 29
)
# Every other printable ASCII byte as a token of its own, so any ASCII text encodes.
FAKE_VOCAB += tuple(bytes([c]) for c in range(32, 127) if bytes([c]) not in FAKE_VOCAB)
FAKE_EOS_ID = 0
FAKE_SPECIAL_IDS = frozenset(range(5))


class FakeStreamingDetokenizer:
    """Like mlx-lm's ``StreamingDetokenizer``: ``text`` grows as whole characters
    arrive (bytes of an unfinished UTF-8 character are held back until it is
    complete or ``finalize`` is called); ``last_segment`` returns the text added
    since it was last read.
    """

    def __init__(self, vocab: Sequence[bytes]):
        self._vocab = vocab
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.text = ""
        self.tokens: list[int] = []
        self._pending = b""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._pending += self._vocab[token]
        text = self._pending.decode("utf-8", "replace")
        if not text.endswith("\ufffd"):
            self.text += text
            self._pending = b""

    def finalize(self) -> None:
        self.text += self._pending.decode("utf-8", "replace")
        self._pending = b""

    @property
    def last_segment(self) -> str:
        segment = self.text[self.offset :]
        self.offset = len(self.text)
        return segment


def _fake_tool_parser(text: str, tools=None):
    return json.loads(text.strip())


class FakeTokenizer:
    """What ``DetokenizerCore`` (and ``make_text_state_machine``) read from a tokenizer."""

    has_thinking = True
    think_start = "<think>"
    think_end = "</think>"
    has_tool_calling = True
    tool_call_start = "<tool_call>"
    tool_call_end = "</tool_call>"
    structural_markers: tuple[str, ...] = ()
    response_transitions: dict = {}  # read-only, as on TokenizerWrapper
    response_initial_state = None

    def __init__(self, vocab: Sequence[bytes] = FAKE_VOCAB, eos_token_ids=(FAKE_EOS_ID,)):
        self.vocab = tuple(vocab)
        self.eos_token_ids = set(eos_token_ids)
        self.tool_parser = _fake_tool_parser

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def detokenizer(self) -> FakeStreamingDetokenizer:
        """A fresh streaming detokenizer on each access, like ``TokenizerWrapper``."""
        return FakeStreamingDetokenizer(self.vocab)

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Greedy longest match over the table (every byte of ``text`` must be covered)."""
        data = text.encode()
        out: list[int] = []
        i = 0
        while i < len(data):
            best = max(
                (t for t, piece in enumerate(self.vocab) if piece and data.startswith(piece, i)),
                key=lambda t: len(self.vocab[t]),
                default=None,
            )
            if best is None:
                raise ValueError(f"cannot encode byte {data[i]:#x} of {text!r}")
            out.append(best)
            i += len(self.vocab[best])
        return out
