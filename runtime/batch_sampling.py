"""One sampler for a whole batch: per-row parameters, seeds and grammar masks, one call.

Owns the sampling state of the sequences of one ``BatchGenerator`` (their
``SamplingParams``, the random keys of seeded rows, their constraints), on the
engine thread. Receives ``register(uid, params, constraint)`` / ``forget(uid)``
from the engine, and each step the batch's logprobs from mlx-lm
(``sampler(logprobs)``) while ``runtime.mlx_lm_batches``' hook has told it the
rows' uids and previous tokens. Emits one lazy token per row.

mlx-lm samples a batch in one call only when every row has the same sampler
object, and loops row by row otherwise. ``BatchSampler`` is that one object:
``make_batch_generator`` makes it the generator's fallback sampler (so every
row inserted with ``samplers=None`` uses it) and installs the row hook.

Per row it follows ``mlx_lm.sample_utils.make_sampler``: temperature 0 is the
argmax (no filter applies); otherwise top-p (0 < p < 1), then min-p (!= 0),
then XTC, then top-k (> 0) restrict the logprobs, and the token is drawn from
``softmax(logprobs / temperature)`` over what is left. Vectorised: one sort of
the batch when any sampled row asks for top-p or top-k (none for min-p alone),
per-row thresholds (top-p's is computed exactly as ``apply_top_p`` does, ties
at the boundary kept; min-p keeps ``logprob >= max + log(min_p)``), top-k by
rank (exactly k tokens, ties broken by the sort), and Gumbel-max with
per-row temperature. A ``top_k`` at or above the vocabulary keeps everything
(mlx-lm raises). Rows with ``xtc_probability > 0`` are rare: each is run
through mlx-lm's own ``apply_*`` chain on its own, inside the same call.

Seeded rows: each has ``mx.random.key(seed)``, split once per sampled token;
its Gumbel noise comes from its own key, so its tokens do not depend on what
else is in the batch (XTC's coin still comes from the global generator, as in
mlx-lm). Unseeded rows draw from the thread's global generator.

Constraints (structured outputs): a row may carry a ``RowConstraint``; the
``ConstraintBackend`` given to the sampler fills the token bitmasks of all
constrained rows in one call per step, in the packed layout llguidance and
xgrammar share (int32, ``ceil(vocab/32)`` words per row, bit j of word i allows
token 32*i+j). A step with a constrained row starts the model's work
(``mx.async_eval``), feeds every constrained row the token it sampled last
step (``consume``; not before its first sample), fills the masks while the
device computes (one packed row per constrained row, copied to the device
and unpacked there), then masks those rows (-inf where not allowed; logits
columns past the backend's vocabulary are disallowed for constrained rows)
before the filters above, which matches mlx-lm with a masking
logits processor. The logprobs mlx-lm reports stay unmasked. A step with no
constrained row adds no synchronisation. In a ``BatchGenerator`` a token is fed
in the step that emits it (mlx-lm's step feeds it to the model and samples the
next), so a constraint has consumed every emitted token, the last included,
when the engine sees it; the token mlx-lm samples beyond a finishing row is
dropped unfed, so ``fill_bitmasks`` may be asked for a row whose constraint has
already accepted its end. A constraint must always allow at least one token.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, apply_xtc

from runtime.decode_lanes import install_decode_lanes
from runtime.engine_generator import EngineBatchGenerator
from runtime.messages import SamplingParams
from runtime.mixed_step import install_mixed_steps
from runtime.mlx_lm_batches import install_row_hooks, queue_prefill_chunks

log = logging.getLogger(__name__)

_NO_TOP_K = 2**31 - 1
_NO_TOP_P = 2.0  # no token has mass above it at or over twice the total: all kept


@runtime_checkable
class RowConstraint(Protocol):
    """One sequence's grammar state, advanced by the tokens it samples."""

    def consume(self, token: int) -> None: ...


@runtime_checkable
class ConstraintBackend(Protocol):
    """Fills the next-token bitmasks of many constrained rows in one call.

    ``vocab_size``: tokens a row's mask describes (``ceil(vocab_size/32)``
    words per row). ``fill_bitmasks(rows, bitmask)``: ``rows`` pairs each
    constraint with its row in ``bitmask`` (an int32 ``(batch, words)`` numpy
    array, every word -1 on entry); write those rows, leave the others. This is
    llguidance's ``fill_next_token_bitmask_par(executor, rows, bitmask)`` and
    xgrammar's per-matcher ``fill_next_token_bitmask(bitmask, index)``.

    Optional: ``preferred_tokens(rows)`` -> ``(row, token)`` pairs that are
    allowed only where the token is the row's own first choice (the argmax
    of its unmasked logprobs): a thinking model may open its thinking block
    before the constrained text only where it would have unconstrained.
    """

    vocab_size: int

    def fill_bitmasks(self, rows: Sequence[tuple[Any, int]], bitmask: np.ndarray) -> None: ...


def validate_params(params: SamplingParams) -> None:
    """Raise ``ValueError`` for parameters mlx-lm's samplers would reject."""
    if params.temperature < 0 or not math.isfinite(params.temperature):
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 <= params.top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {params.top_p}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if not 0.0 <= params.xtc_probability <= 1.0:
        raise ValueError(f"xtc_probability must be in [0, 1], got {params.xtc_probability}")
    if params.xtc_probability > 0 and not 0.0 <= params.xtc_threshold <= 0.5:
        raise ValueError(f"xtc_threshold must be in [0, 0.5], got {params.xtc_threshold}")


@attrs.define(slots=True)
class _Row:
    params: SamplingParams
    constraint: Any = None
    key: Any = None  # mx.random key of a seeded row
    sampled: bool = False  # a constrained row: sampled at least once (its inputs are samples)


@attrs.define
class _Plan:
    """What one row set needs, built once per set of rows (cached while it lasts).

    While it lasts it holds its seeded rows' keys stacked (``seeded_keys``);
    they go back to the rows when the row set changes.
    """

    rows: tuple[_Row, ...]
    greedy_rows: int
    greedy: Any  # (n,) bool, None when no row is greedy or every row is
    inverse_temperature: Any  # (n, 1) float32; 1 for greedy rows
    top_p: Any  # (n, 1) float32 or None
    log_min_p: Any  # (n, 1) float32 or None
    top_k: Any  # (n, 1) int32 or None
    seeded: tuple[int, ...]
    xtc: tuple[int, ...]
    constrained: tuple[int, ...]
    constrained_index: Any  # (len(constrained),) int32: the rows of ``constrained``
    seeded_index: Any = None  # (m,) int32 rows of ``seeded``
    seeded_keys: Any = None  # (m, 2) their current keys

    def return_keys(self) -> None:
        for j, i in enumerate(self.seeded):
            self.rows[i].key = self.seeded_keys[j]


class BatchSampler:
    """The one sampler object every row of a ``BatchGenerator`` shares.

    ``register(uid, params, constraint)`` after inserting a sequence,
    ``forget(uid)`` when it finishes or is removed, ``clear()`` when the
    generator is replaced (uids start again at 0). Unregistered rows are greedy.
    """

    def __init__(
        self,
        *,
        xtc_special_tokens: Sequence[int] = (),
        constraint_backend: ConstraintBackend | None = None,
    ):
        self._xtc_special = list(xtc_special_tokens)
        self._backend = constraint_backend
        self._rows: dict[int, _Row] = {}
        self._greedy_row = _Row(params=SamplingParams())
        self._bound: Sequence[int] | None = None
        self._inputs: Any = None
        self._plan_key: tuple[int, ...] | None = None
        self._plan: _Plan | None = None
        self._bitmask: np.ndarray | None = None
        self.calls = 0  # sampler calls (one per batch and step)
        self.constrained_calls = 0  # of which with at least one constrained row

    # ------------------------------------------------------------ registry

    def register(
        self, uid: int, params: SamplingParams, constraint: RowConstraint | None = None
    ) -> None:
        validate_params(params)
        if constraint is not None and self._backend is None:
            raise ValueError("a constrained row needs a BatchSampler with a constraint_backend")
        key = None
        if params.seed is not None and params.temperature > 0:
            key = mx.random.key(params.seed)
        self._rows[uid] = _Row(params=params, constraint=constraint, key=key)
        self._plan_key = None

    def forget(self, uid: int) -> None:
        if self._rows.pop(uid, None) is not None:
            self._plan_key = None

    def clear(self) -> None:
        self._rows.clear()
        self._plan_key = None

    @property
    def registered(self) -> int:
        """Rows registered now (no ``__len__``: mlx-lm tests the sampler's truth)."""
        return len(self._rows)

    # ---------------------------------------------------------------- hook

    @contextlib.contextmanager
    def sampling_rows(self, uids: Sequence[int], inputs: Any) -> Iterator[None]:
        """While it lasts, calls sample the rows ``uids``, whose previous tokens are ``inputs``.

        ``inputs``: an (n,) mx.array of the tokens fed to the model this step
        (each row's previous sample), or ``None`` when every row is sampled for
        the first time. Installed by ``runtime.mlx_lm_batches``.
        """
        self._bound, self._inputs = uids, inputs
        try:
            yield
        finally:
            self._bound = self._inputs = None

    # ------------------------------------------------------------ sampling

    def __call__(self, logprobs: mx.array) -> mx.array:
        uids = self._bound
        if uids is None:
            raise RuntimeError(
                "BatchSampler called without its rows: build the generator with "
                "make_batch_generator"
            )
        if logprobs.shape[0] != len(uids):
            raise RuntimeError(
                f"BatchSampler got {logprobs.shape[0]} rows for {len(uids)} sequences: "
                "every row of the batch must use this sampler (samplers=None)"
            )
        self.calls += 1
        plan = self._plan_for(uids)
        x = logprobs
        if plan.constrained:
            self.constrained_calls += 1
            x = self._apply_constraints(x, plan)
        if plan.greedy_rows == len(plan.rows):
            return mx.argmax(x, axis=-1)
        tokens = self._sample(x, plan)
        if plan.greedy is not None:
            tokens = mx.where(plan.greedy, mx.argmax(x, axis=-1), tokens)
        return tokens

    def _plan_for(self, uids: Sequence[int]) -> _Plan:
        key = tuple(uids)
        if key != self._plan_key or self._plan is None:
            if self._plan is not None:
                self._plan.return_keys()
            self._plan = self._make_plan([self._rows.get(u, self._greedy_row) for u in key])
            self._plan_key = key
        return self._plan

    def _make_plan(self, rows: list[_Row]) -> _Plan:
        n = len(rows)
        greedy = [r.params.temperature == 0 for r in rows]
        sampled = [r.params for r, g in zip(rows, greedy, strict=True) if not g]
        uses_top_p = any(0 < p.top_p < 1 for p in sampled)
        uses_min_p = any(p.min_p != 0 for p in sampled)
        uses_top_k = any(p.top_k > 0 for p in sampled)
        greedy_rows = sum(greedy)

        def column(values, dtype):
            return mx.array(values, dtype=dtype).reshape(n, 1)

        seeded = tuple(i for i, r in enumerate(rows) if r.key is not None)
        return _Plan(
            rows=tuple(rows),
            greedy_rows=greedy_rows,
            greedy=mx.array(greedy) if 0 < greedy_rows < n else None,
            inverse_temperature=column(
                [
                    1.0 if g else 1.0 / r.params.temperature
                    for r, g in zip(rows, greedy, strict=True)
                ],
                mx.float32,
            ),
            top_p=column(
                [r.params.top_p if 0 < r.params.top_p < 1 else _NO_TOP_P for r in rows],
                mx.float32,
            )
            if uses_top_p
            else None,
            log_min_p=column(
                [math.log(r.params.min_p) if r.params.min_p > 0 else -math.inf for r in rows],
                mx.float32,
            )
            if uses_min_p
            else None,
            top_k=column([r.params.top_k or _NO_TOP_K for r in rows], mx.int32)
            if uses_top_k
            else None,
            seeded=seeded,
            seeded_index=mx.array(seeded, dtype=mx.int32) if seeded else None,
            seeded_keys=mx.stack([rows[i].key for i in seeded]) if seeded else None,
            xtc=tuple(
                i
                for i, (r, g) in enumerate(zip(rows, greedy, strict=True))
                if not g and r.params.xtc_probability > 0
            ),
            constrained=tuple(i for i, r in enumerate(rows) if r.constraint is not None),
            constrained_index=mx.array(
                [i for i, r in enumerate(rows) if r.constraint is not None], dtype=mx.int32
            ),
        )

    def _noise(self, plan: _Plan, shape: tuple[int, int]) -> mx.array:
        """Gumbel noise, one row per sequence; seeded rows' from their own keys."""
        n, vocab = shape
        if not plan.seeded:
            return mx.random.gumbel(shape=(n, vocab))
        plan.seeded_keys, seeded = _seeded_noise(vocab)(plan.seeded_keys)
        if len(plan.seeded) == n:
            return seeded
        noise = mx.random.gumbel(shape=(n, vocab))
        noise[plan.seeded_index] = seeded
        return noise

    def _sample(self, x: mx.array, plan: _Plan) -> mx.array:
        n, vocab = x.shape
        noise = self._noise(plan, (n, vocab))
        kernel = _sampling_kernel(
            plan.top_p is not None, plan.log_min_p is not None, plan.top_k is not None
        )
        columns = [c for c in (plan.top_p, plan.log_min_p, plan.top_k) if c is not None]
        tokens = kernel(x, noise, plan.inverse_temperature, *columns)
        if plan.xtc:
            tokens[mx.array(plan.xtc)] = mx.concatenate(
                [
                    self._sample_xtc_row(x[i : i + 1], plan.rows[i].params, noise[i : i + 1])
                    for i in plan.xtc
                ]
            )
        return tokens

    def _sample_xtc_row(self, x: mx.array, params: SamplingParams, noise: mx.array) -> mx.array:
        """mlx-lm's own filter chain, in ``make_sampler``'s order, for one XTC row."""
        if 0 < params.top_p < 1:
            x = apply_top_p(x, params.top_p)
        if params.min_p != 0:
            x = apply_min_p(x, params.min_p)
        x = apply_xtc(x, params.xtc_probability, params.xtc_threshold, self._xtc_special)
        if 0 < params.top_k < x.shape[-1]:
            x = apply_top_k(x, params.top_k)
        return mx.argmax(x * (1.0 / params.temperature) + noise, axis=-1)

    def _apply_constraints(self, x: mx.array, plan: _Plan) -> mx.array:
        backend = self._backend
        mx.async_eval(x)  # the model's work starts; the masks are computed meanwhile
        rows = plan.rows
        need_previous = [i for i in plan.constrained if rows[i].sampled]
        if need_previous:
            if self._inputs is None:
                raise RuntimeError("constrained rows need their previous tokens")
            previous = self._inputs.tolist()
            for i in need_previous:
                rows[i].constraint.consume(previous[i])
        # One packed mask row per constrained row (not per batch row): only those
        # rows are filled, copied to the device and unpacked.
        m = len(plan.constrained)
        words = (backend.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape != (m, words):
            self._bitmask = np.empty((m, words), dtype=np.int32)
        bitmask = self._bitmask
        bitmask.fill(-1)
        matchers = [(rows[i].constraint, j) for j, i in enumerate(plan.constrained)]
        backend.fill_bitmasks(matchers, bitmask)
        for i in plan.constrained:
            rows[i].sampled = True
        vocab = x.shape[1]
        allowed_width = min(backend.vocab_size, vocab)
        preferred = getattr(backend, "preferred_tokens", None)
        firsts = preferred(matchers) if preferred is not None else ()
        every_row = m == len(rows)
        x_rows = x if every_row else x[plan.constrained_index]
        allowed = unpack_bitmask(mx.array(bitmask), allowed_width, vocab)
        if firsts:  # allowed only as the row's own first choice (no synchronisation)
            index = mx.array([j for j, _ in firsts], dtype=mx.int32)
            tokens = mx.array([t for _, t in firsts], dtype=mx.int32)
            first_choice = mx.argmax(x_rows[index], axis=-1).astype(mx.int32) == tokens
            allowed[index, tokens] = allowed[index, tokens] | first_choice
        masked = mx.where(allowed, x_rows, -mx.inf)
        if every_row:
            return masked
        x = mx.array(x)  # a copy: the logprobs mlx-lm reports stay unmasked
        x[plan.constrained_index] = masked
        return x


def unpack_bitmask(bitmask: mx.array, vocab_size: int, width: int) -> mx.array:
    """(n, words) int32 packed bits -> (n, width) bool; tokens >= ``vocab_size`` False."""
    n = bitmask.shape[0]
    bits = mx.right_shift(bitmask[:, :, None], mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(n, -1)[:, :vocab_size].astype(mx.bool_)
    if vocab_size < width:
        allowed = mx.concatenate([allowed, mx.zeros((n, width - vocab_size), mx.bool_)], axis=1)
    return allowed


def _top_p_threshold(ascending: mx.array, top_p: mx.array) -> mx.array:
    """The smallest logprob top-p keeps, per row, as ``apply_top_p`` computes it."""
    probs = mx.exp(ascending.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[:, :1] + probs[:, :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    dropped = mx.minimum(dropped, ascending.shape[-1] - 1)
    return mx.take_along_axis(ascending, dropped, axis=-1)


def _min_p_threshold(top: mx.array, log_min_p: mx.array) -> mx.array:
    """``max + log(min_p)`` in the logprobs' dtype, as ``apply_min_p`` computes it."""
    return top + log_min_p.astype(top.dtype)


@functools.cache
def _seeded_noise(vocab: int):
    """keys (m, 2) -> (next keys, Gumbel noise (m, vocab)): each key split once, vectorised."""

    def one_row(key):
        key, draw = mx.random.split(key)
        return key, mx.random.gumbel(shape=(vocab,), key=draw)

    return mx.compile(mx.vmap(one_row))


@functools.cache
def _sampling_kernel(top_p: bool, min_p: bool, top_k: bool):
    """The compiled Gumbel-max sampler for one combination of filters in use.

    ``f(x, noise, inverse_temperature, [top_p], [log_min_p], [top_k])`` with
    (n, 1) columns; rows that do not use a filter carry its neutral value.
    Without top-k it works on the tokens (top-p sorts the values only); with
    top-k on the ascending sort, where a rank is a position.
    """

    def in_token_space(x, noise, inverse_temperature, *columns):
        columns = list(columns)
        scores = x * inverse_temperature.astype(x.dtype) + noise
        keep = None
        if top_p:
            keep = x >= _top_p_threshold(mx.sort(x, axis=-1), columns.pop(0))
        if min_p:
            top = mx.max(x, axis=-1, keepdims=True)
            above = x >= _min_p_threshold(top, columns.pop(0))
            keep = above if keep is None else keep & above
        if keep is not None:
            scores = mx.where(keep, scores, -mx.inf)
        return mx.argmax(scores, axis=-1)

    def in_sorted_space(x, noise, inverse_temperature, *columns):
        columns = list(columns)
        vocab = x.shape[-1]
        order = mx.argsort(x, axis=-1)
        values = mx.take_along_axis(x, order, axis=-1)
        keep = mx.arange(vocab) >= vocab - columns[-1]
        if top_p:
            keep = keep & (values >= _top_p_threshold(values, columns.pop(0)))
        if min_p:
            keep = keep & (values >= _min_p_threshold(values[:, -1:], columns.pop(0)))
        scores = values * inverse_temperature.astype(x.dtype)
        scores = scores + mx.take_along_axis(noise, order, axis=-1)
        position = mx.argmax(mx.where(keep, scores, -mx.inf), axis=-1)
        return mx.take_along_axis(order, position[:, None], axis=-1)[:, 0]

    return mx.compile(in_sorted_space if top_k else in_token_space)


def make_batch_generator(model, *, sampler: BatchSampler, chunk_pass: str = "separate",
                         queue_chunks: bool = False, lane_padding: int = 0,
                         chunk_parts: int = 1, **kwargs):
    """A ``BatchGenerator`` whose rows all sample through ``sampler``, one call per step.

    ``kwargs`` go to ``BatchGenerator`` (``completion_batch_size``, ``stream``,
    ...). Insert sequences with ``samplers=None`` (or ``[None]``) and register
    each uid with ``sampler.register``. ``chunk_pass`` "shared": a step's prefill
    chunk and the next decode step in one forward pass where the model allows
    (``runtime.mixed_step``); "separate": two, as mlx-lm runs them. ``queue_chunks``:
    where passes are shared, a prefill chunk is queued without waiting for the device
    while sequences decode (``runtime.mlx_lm_batches.RowAwarePromptBatch``).
    ``lane_padding``: ``runtime.decode_lanes``' padding limit (0: one decode batch).
    ``chunk_parts``: steps a shared chunk's layers may spread over (``ChunkInFlight``).
    """
    if "sampler" in kwargs:
        raise TypeError("make_batch_generator takes its sampler as a BatchSampler")
    generator = install_row_hooks(EngineBatchGenerator(model, sampler=sampler, **kwargs))
    install_decode_lanes(generator, lane_padding)
    if chunk_pass == "shared" and install_mixed_steps(generator, chunk_parts) and queue_chunks:
        # Measured on an H200 beside shared passes only: with two passes a step, queued
        # chunks made the streams' steps longer (docs/performance.md).
        queue_prefill_chunks(generator)
    return generator
