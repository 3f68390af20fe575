"""Structured outputs, engine side: per-sequence grammar state and packed token bitmasks.

No trio, no HTTP, no MLX (numpy and llguidance only). ``grammar_tokenizer``
turns the model's tokenizer into llguidance's form once (cached per
tokenizer and mask width); ``ConstraintSpec.new_matcher``
(``runtime.grammar.compiler``) makes one ``RowMatcher`` per sequence;
``fill_bitmasks`` fills the packed token bitmasks of all constrained rows of
a step in ONE llguidance call (parallel over its thread pool). Layout: int32
words, bit ``j`` of word ``i`` allows token ``32 * i + j``.

A row goes through phases: ``reasoning`` (the prompt ends inside a thinking
block, or the model opened one as its first token, where it would have
unconstrained: ``RowMatcher.preferred_opening``; anything but end-of-sequence
until the think-end marker), ``grammar`` (llguidance decides; once the grammar is
complete only end-of-sequence tokens are allowed) and, for
``tool_choice: "none"``, ``free`` (everything but the tool-call start marker).
A grammar that cannot finish within ``max_tokens`` simply runs out of tokens
(finish reason ``length``): nothing here needs to know. Nothing here raises
once a matcher exists: a token outside the grammar, or an error inside
llguidance, puts that row in the ``failed`` phase (end-of-sequence only,
logged), so one row never fails a batch's step.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

log = logging.getLogger(__name__)


# Compiled grammars kept per tokenizer (``GrammarTokenizer.new_ll_matcher``).
MATCHER_TEMPLATES = 64


class GrammarTokenizer:
    """A tokenizer in llguidance's form, for masks ``vocab_size`` tokens wide.

    Build through ``grammar_tokenizer`` (cached). ``vocab_size`` is the
    model's logits width, which may exceed the tokenizer's own vocabulary;
    tokens past the tokenizer's are never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or {hf.eos_token_id})
        self.ll = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = self.ll.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.eos_token_ids = tuple(eos)
        every = np.full(self.words, -1, dtype=np.int32)
        tail = self.vocab_size % 32
        if tail:
            every.view(np.uint32)[-1] = (1 << tail) - 1
        self.every_row = every
        self.no_eos_row = _with_bits(every, eos, False)
        self.eos_only_row = _with_bits(np.zeros(self.words, dtype=np.int32), eos, True)
        self._templates: dict[str, llguidance.LLMatcher] = {}
        self._templates_lock = threading.Lock()

    def new_ll_matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh llguidance matcher for ``grammar`` (``ValueError``: rejected).

        Compiling a grammar against the vocabulary costs milliseconds (more for
        large schemas and vocabularies), on the engine's thread; clients send the
        same schema or tools again and again (an agent, every turn). So the last
        ``MATCHER_TEMPLATES`` grammars are kept compiled and each request gets a
        copy (``deep_copy``: tens of microseconds).
        """
        with self._templates_lock:
            template = self._templates.pop(grammar, None)
            if template is None:
                template = llguidance.LLMatcher(self.ll, grammar, log_level=0)
                if template.is_error():
                    raise ValueError(f"grammar rejected by the engine: {template.get_error()}")
            self._templates[grammar] = template  # the most recent last
            while len(self._templates) > MATCHER_TEMPLATES:
                del self._templates[next(iter(self._templates))]
            return template.deep_copy()

    def allocate(self, rows: int) -> np.ndarray:
        """A C-contiguous (rows, words) int32 bitmask, all allowed."""
        return llguidance.numpy.allocate_token_bitmask(rows, self.vocab_size)


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int | None = None) -> GrammarTokenizer:
    """The cached ``GrammarTokenizer`` of ``tokenizer`` for masks ``vocab_size`` wide.

    The first call per tokenizer costs ~0.02 s for a 1k vocabulary and a few
    seconds for 150k (build it when the model loads); later calls are a
    dictionary lookup. Thread-safe.
    """
    with _tokenizers_lock:
        by_size = _tokenizers.setdefault(tokenizer, {})
        built = by_size.get(vocab_size)
        if built is None:
            built = by_size[vocab_size] = GrammarTokenizer(tokenizer, vocab_size)
        return built


def _with_bits(row: np.ndarray, tokens, allowed: bool) -> np.ndarray:
    row = row.copy()
    bits = row.view(np.uint32)
    for token in tokens:
        if allowed:
            bits[token // 32] |= np.uint32(1 << (token % 32))
        else:
            bits[token // 32] &= ~np.uint32(1 << (token % 32))
    return row


class RowMatcher:
    """One sequence's constraint state on the engine side.

    ``spec`` is its ``ConstraintSpec``. ``consume(token)`` with every token
    the sequence produces; ``fill_bitmasks`` writes what it allows next. A
    token the mask did not allow (the caller skipped the mask), or an error
    inside llguidance, puts the matcher in the ``failed`` phase: it then
    allows only end-of-sequence, and ``error`` says why. Only the
    constructor raises (``ValueError``: a grammar the engine rejects).
    """

    __slots__ = ("spec", "phase", "error", "_ll", "_tokenizer", "_started", "_recent", "_free_row")

    def __init__(self, spec: Any, tokenizer: GrammarTokenizer):
        self.spec = spec
        self._tokenizer = tokenizer
        self.error: str | None = None
        self._started = False  # any token consumed yet
        self._recent: list[int] = []  # the last few tokens, for multi-token markers
        self._ll = None
        if spec.grammar is not None:
            self._ll = tokenizer.new_ll_matcher(spec.grammar)
        singles = [seq[0] for seq in spec.banned if len(seq) == 1]
        if spec.grammar is None:
            self.phase = "free"
            self._free_row = _with_bits(tokenizer.every_row, singles, False)
        else:
            self.phase = "reasoning" if spec.start_in_reasoning else "grammar"
            # reasoning: anything but the end of the sequence (the constrained text must follow)
            self._free_row = _with_bits(tokenizer.no_eos_row, singles, False)

    def consume(self, token: int) -> None:
        opening = self.may_open_thinking
        self._started = True
        if self.phase == "grammar":
            if opening and token == self.spec.think_start:
                self.phase = "reasoning"  # the model opened a thinking block first
                self._remember(token)
            elif self._ll.is_stopped() and token in self._tokenizer.eos_token_ids:
                pass  # the end of a complete document
            else:
                try:
                    accepted = self._ll.consume_token(token)
                except Exception as exc:  # llguidance's own failure: this row only
                    self._fail(f"llguidance failed on token {token}: {exc}")
                    return
                if not accepted:
                    self._fail(f"token {token} is outside the grammar: {self._ll.get_error()}")
        elif self.phase == "reasoning":
            self._remember(token)
            end = self.spec.think_end
            if end and tuple(self._recent[-len(end):]) == end:
                self.phase = "grammar"
        elif self.phase == "free":
            self._remember(token)

    @property
    def may_open_thinking(self) -> bool:
        return self.phase == "grammar" and self.spec.think_start is not None and not self._started

    @property
    def preferred_opening(self) -> int | None:
        """A token allowed next only if it is the model's own first choice, or None.

        Before its first token a row may open a thinking block (``think_start``)
        instead of the constrained text, but only where the model would have
        done so unconstrained: the mask leaves the bit clear and the sampler
        sets it for rows whose unmasked argmax is this token. (A model that
        would have chatted, offered only the constrained text or a thinking
        block, otherwise escapes into thinking that nothing bounds.)
        """
        return self.spec.think_start if self.may_open_thinking else None

    def _remember(self, token: int) -> None:
        self._recent.append(token)
        keep = max([len(self.spec.think_end)] + [len(s) for s in self.spec.banned])
        if len(self._recent) > keep:
            del self._recent[:-keep]

    def _fail(self, reason: str) -> None:
        log.warning("constrained sequence left its grammar (%s); ending it", reason)
        self.phase, self.error = "failed", reason

    def _fix_row(self, row: np.ndarray) -> None:
        """Bits the grammar alone does not clear: banned sequences (see ``preferred_opening``)."""
        bits = row.view(np.uint32)
        if self.phase in ("free", "reasoning"):
            for seq in self.spec.banned:
                if len(seq) > 1 and tuple(self._recent[-(len(seq) - 1):]) == seq[:-1]:
                    t = seq[-1]
                    bits[t // 32] &= ~np.uint32(1 << (t % 32))


# Fewer grammar rows than this are filled one after another on the calling thread,
# more on llguidance's pool. The fill runs while the device computes the step, so a
# longer fill costs nothing until it outlasts the device; the pool's threads compete
# with MLX's for the host. On an H200 (bench/constrained_step.py, 64 rows, 16 of them
# constrained) steps filled on the engine thread were 0.2-1.1 ms shorter in five reps
# of five, though the fill itself took 0.6 ms against 0.4 on the pool.
PARALLEL_FILL_MIN_ROWS = 32

_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()  # 80 % of the CPUs, at most 32 threads
        return _executor


def fill_bitmasks(
    matchers: Sequence[RowMatcher], bitmask: np.ndarray, rows: Sequence[int] | None = None
) -> None:
    """Write what each matcher allows next into ``bitmask[rows[i]]`` (default: row ``i``).

    ``bitmask``: a C-contiguous int32 array ``(n, words)`` with ``words ==
    tokenizer.words`` (``GrammarTokenizer.allocate``). All rows in the grammar
    phase are filled by one llguidance call, in parallel on its thread pool
    (the GIL is released), or one by one when they are fewer than
    ``PARALLEL_FILL_MIN_ROWS``; the others get precomputed rows.
    """
    if rows is None:
        rows = range(len(matchers))
    grammar_rows, grammar_matchers = [], []
    for matcher, row in zip(matchers, rows, strict=True):
        if matcher.phase == "grammar":
            grammar_rows.append((matcher._ll, row))
            grammar_matchers.append(matcher)
        elif matcher.phase == "failed":
            bitmask[row] = matcher._tokenizer.eos_only_row
        else:
            bitmask[row] = matcher._free_row
    if len(grammar_rows) >= PARALLEL_FILL_MIN_ROWS:
        try:
            llguidance.numpy.fill_next_token_bitmask_par(_shared_executor(), grammar_rows, bitmask)
        except Exception:  # one row's failure must not fail the others: fill them one by one
            log.exception("batched mask fill failed; filling %d rows one by one", len(grammar_rows))
            _fill_one_by_one(grammar_matchers, grammar_rows, bitmask)
    else:
        _fill_one_by_one(grammar_matchers, grammar_rows, bitmask)
    for matcher, (ll, row) in zip(grammar_matchers, grammar_rows, strict=True):
        if ll.is_error():  # e.g. a parser limit hit while computing this mask
            matcher._fail(ll.get_error())
            bitmask[row] = matcher._tokenizer.eos_only_row
    for matcher, row in zip(matchers, rows, strict=True):
        if matcher.spec.banned:
            matcher._fix_row(bitmask[row])


def _fill_one_by_one(matchers: Sequence[RowMatcher], rows: Sequence[tuple[Any, int]],
                     bitmask: np.ndarray) -> None:
    for matcher, (ll, row) in zip(matchers, rows, strict=True):
        try:
            llguidance.numpy.fill_next_token_bitmask(ll, bitmask, row)
        except Exception as exc:
            matcher._fail(f"llguidance could not compute the mask: {exc}")
            bitmask[row] = matcher._tokenizer.eos_only_row
