"""BatchSampler: one call per batch and step, per-row parameters, seeds, constraints.

Direct tests on arrays (rows bound by hand through ``sampling_rows``, numpy
references for mlx-lm's filter definitions, mlx-lm's own ``make_sampler`` for
the distributions) and tests through a real ``BatchGenerator`` on the tiny model
(the row hook, the first-sample / previous-token bookkeeping, mixed batches).
"""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import make_sampler

from runtime import mlx_lm_batches
from runtime.batch_sampling import BatchSampler, make_batch_generator, unpack_bitmask
from runtime.messages import SamplingParams

# --------------------------------------------------------------- helpers


def draw(sampler: BatchSampler, uids, logprobs, inputs=None) -> list[int]:
    with sampler.sampling_rows(list(uids), inputs):
        tokens = sampler(logprobs)
    return tokens.tolist()


def normalize(logits: np.ndarray) -> mx.array:
    x = mx.array(logits.astype(np.float32))
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def reference_allowed(lp: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, float]:
    """mlx-lm's top-p, min-p, top-k (in make_sampler's order) in float64, and the
    smallest distance of any token to a boundary (small: float rounding may decide)."""
    x = lp.astype(np.float64)
    allowed = np.ones(x.shape, bool)
    margin = math.inf
    if 0 < p.top_p < 1:
        asc = np.sort(x)
        probs = np.exp(asc)
        total = probs.sum()
        mass_above = total - np.cumsum(probs)  # strictly above each sorted token
        margin = min(margin, np.min(np.abs(mass_above - p.top_p * total)))
        threshold = asc[(mass_above >= p.top_p * total).sum()]
        allowed &= x >= threshold
    if p.min_p > 0:
        threshold = x.max() + math.log(p.min_p)
        margin = min(margin, np.min(np.abs(x - threshold)))
        allowed &= x >= threshold
    if 0 < p.top_k < len(x):
        ranked = np.sort(np.where(allowed, x, -np.inf))[::-1]
        if np.isfinite(ranked[p.top_k]):
            margin = min(margin, ranked[p.top_k - 1] - ranked[p.top_k])
        allowed &= np.where(allowed, x, -np.inf) >= ranked[p.top_k - 1]
    return allowed, margin


def reference_probs(lp: np.ndarray, p: SamplingParams) -> np.ndarray:
    allowed, _ = reference_allowed(lp, p)
    z = np.where(allowed, lp.astype(np.float64) / p.temperature, -np.inf)
    z = np.exp(z - z.max())
    return z / z.sum()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    rest_expected = expected[~big].sum()
    stat = float((((counts[big] - expected[big]) ** 2) / expected[big]).sum())
    dof = int(big.sum()) - 1
    if rest_expected >= 5:
        stat += (counts[~big].sum() - rest_expected) ** 2 / rest_expected
        dof += 1
    return stat, dof


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    assert counts[probs == 0].sum() == 0, "a filtered-out token was sampled"
    stat, dof = chi_square(counts, probs)
    # Loose: about 6 standard deviations of the chi-square above its mean.
    assert stat < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10, (stat, dof)


# ------------------------------------------------------- filters (arrays)

row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.8]),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 0.99)),
    min_p=st.one_of(st.just(0.0), st.floats(0.01, 0.6)),
    top_k=st.one_of(st.just(0), st.integers(1, 70)),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=st.lists(row_params, min_size=1, max_size=6),
    vocab=st.sampled_from([16, 37, 64]),  # few shapes: each is compiled once
    scale=st.floats(0.5, 8.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_never_leave_their_allowed_set(params, vocab, scale, seed):
    logits = np.random.default_rng(seed).normal(size=(len(params), vocab)) * scale
    lp = normalize(logits)
    lp_np = np.array(lp)
    allowed = []
    for row, p in zip(lp_np, params, strict=True):
        ok, margin = reference_allowed(row, p)
        assume(margin > 1e-4)
        allowed.append(ok)
    sampler = BatchSampler()
    for uid, p in enumerate(params):
        sampler.register(uid, p)
    for _ in range(6):
        tokens = draw(sampler, range(len(params)), lp)
        for row, (token, p, ok) in enumerate(zip(tokens, params, allowed, strict=True)):
            if p.temperature == 0:
                assert token == int(np.argmax(lp_np[row]))
            else:
                assert ok[token], (row, token, p)


def test_distributions_match_make_sampler_and_the_definition():
    rng = np.random.default_rng(7)
    lp_row = np.array(normalize(rng.normal(size=(1, 24)) * 2.0))[0]
    cases = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.08),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, top_k=6),
    ]
    per_case = 3000
    lp = mx.array(np.tile(lp_row, (per_case * len(cases), 1)))
    sampler = BatchSampler()
    for i in range(per_case * len(cases)):
        sampler.register(i, cases[i // per_case])
    mx.random.seed(11)
    tokens = np.array(draw(sampler, range(per_case * len(cases)), lp))
    for c, p in enumerate(cases):
        probs = reference_probs(lp_row, p)
        ours = np.bincount(tokens[c * per_case : (c + 1) * per_case], minlength=len(lp_row))
        assert_matches(ours, probs)
        # the reference is mlx-lm's own sampler's distribution
        theirs = make_sampler(p.temperature, top_p=p.top_p, min_p=p.min_p, top_k=p.top_k)(
            mx.array(np.tile(lp_row, (per_case, 1)))
        )
        assert_matches(np.bincount(np.array(theirs), minlength=len(lp_row)), probs)


def test_xtc_rows_are_sampled_in_the_same_call_with_mlx_lm_semantics():
    # XTC (threshold 0.1, always on) removes every token above the threshold
    # but the least likely of them: tokens 0 and 1 here.
    probs = np.array([0.5, 0.3, 0.12, 0.05, 0.02, 0.01])
    lp = mx.array(np.tile(np.log(probs), (3, 1)).astype(np.float32))
    sampler = BatchSampler()
    sampler.register(0, SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1))
    sampler.register(1, SamplingParams())
    sampler.register(2, SamplingParams(temperature=1.0, xtc_probability=1.0, top_k=2))
    xtc_only, xtc_top_k = Counter(), Counter()
    for _ in range(300):
        a, greedy, b = draw(sampler, [0, 1, 2], lp)
        xtc_only[a] += 1
        xtc_top_k[b] += 1
        assert greedy == 0
    assert sampler.calls == 300
    assert set(xtc_only) == {2, 3, 4, 5}
    assert set(xtc_top_k) == {2, 3}  # top-k applies after XTC, as in make_sampler


# ---------------------------------------------------------- seeds (arrays)


def _seeded_run(seed_row: SamplingParams, others: list[SamplingParams], position: int):
    rng = np.random.default_rng(3)
    steps = [normalize(rng.normal(size=(1, 48)) * 2.0) for _ in range(25)]
    sampler = BatchSampler()
    rows = others[:position] + [seed_row] + others[position:]
    for uid, p in enumerate(rows):
        sampler.register(uid, p)
    out = []
    for step in steps:
        noise = normalize(np.random.default_rng(len(out)).normal(size=(len(rows), 48)))
        lp = mx.concatenate([noise[:position], step, noise[position + 1 :]])
        out.append(draw(sampler, range(len(rows)), lp)[position])
    return out


def test_a_seeded_row_is_reproducible_whatever_else_is_in_the_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    mx.random.seed(1)
    alone = _seeded_run(seeded, [], 0)
    mx.random.seed(2)
    # beside rows that send the batch through the sorted (top-k) path
    beside = _seeded_run(
        seeded,
        [
            SamplingParams(temperature=0.9, top_k=3),
            SamplingParams(),
            SamplingParams(temperature=1.0, seed=7),
            SamplingParams(temperature=0.6, min_p=0.1, xtc_probability=0.5),
        ],
        2,
    )
    mx.random.seed(3)
    again = _seeded_run(seeded, [SamplingParams(temperature=2.0)], 1)
    assert alone == beside == again
    other_seed = _seeded_run(SamplingParams(temperature=1.0, top_p=0.95, seed=43), [], 0)
    assert other_seed != alone


def test_a_seeded_row_keeps_its_stream_while_rows_come_and_go():
    rng = np.random.default_rng(4)
    steps = [normalize(rng.normal(size=(1, 40)) * 2.0) for _ in range(12)]
    others = normalize(rng.normal(size=(3, 40)))

    def tokens_of_row_0(row_sets):
        sampler = BatchSampler()
        sampler.register(0, SamplingParams(temperature=1.0, top_k=10, seed=77))
        sampler.register(1, SamplingParams(temperature=0.7, seed=1))
        sampler.register(2, SamplingParams(temperature=1.0, top_p=0.8))
        out = []
        for step, rows in zip(steps, row_sets, strict=True):
            lp = mx.concatenate([step if u == 0 else others[u : u + 1] for u in rows])
            out.append(draw(sampler, rows, lp)[rows.index(0)])
        return out

    alone = tokens_of_row_0([[0]] * 12)
    shuffled = tokens_of_row_0([[0], [1, 0], [1, 0, 2], [0], [2, 0]] * 2 + [[0, 1], [0]])
    assert alone == shuffled


def test_unconstrained_calls_add_no_synchronisation(monkeypatch):
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the previous tokens were read ({name})")

    def no_async_eval(*args, **kwargs):
        raise AssertionError("an unconstrained call started an evaluation")

    sampler = BatchSampler()
    sampler.register(0, SamplingParams(temperature=0.8, top_p=0.9, seed=5))
    sampler.register(1, SamplingParams(temperature=1.0, top_k=4))
    monkeypatch.setattr(mx, "async_eval", no_async_eval)
    monkeypatch.setattr(mx, "eval", no_async_eval)
    with sampler.sampling_rows([0, 1], Untouchable()):
        tokens = sampler(normalize(np.random.default_rng(0).normal(size=(2, 32))))
    monkeypatch.undo()
    assert len(tokens.tolist()) == 2


def test_the_sampler_refuses_rows_it_cannot_identify():
    sampler = BatchSampler()
    lp = normalize(np.zeros((2, 8)))
    with pytest.raises(RuntimeError, match="without its rows"):
        sampler(lp)
    with sampler.sampling_rows([0, 1, 2], None), pytest.raises(RuntimeError, match="every row"):
        sampler(lp)
    with pytest.raises(ValueError, match="top_p"):
        sampler.register(0, SamplingParams(temperature=1.0, top_p=1.5))


# ----------------------------------------------------- constraints (fakes)


class AllowSet:
    """A constraint that allows a fixed token set and records what it is fed."""

    def __init__(self, allowed):
        self.allowed = sorted(allowed)
        self.consumed: list[int] = []

    def consume(self, token: int) -> None:
        assert token in self.allowed, f"fed a token it does not allow: {token}"
        self.consumed.append(token)


class FakeBackend:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.fills: list[list[int]] = []

    def fill_bitmasks(self, rows, bitmask):
        self.fills.append([i for _, i in rows])
        for constraint, i in rows:
            bits = np.zeros(bitmask.shape[1] * 32, dtype=np.uint8)
            bits[constraint.allowed] = 1
            bitmask[i] = np.packbits(bits, bitorder="little").view(np.int32)


def test_unpack_bitmask_layout_and_padding():
    words = np.zeros((2, 2), dtype=np.int32)
    words[0, 0] = 1 << 3
    words[0, 1] = np.int32(-(2**31))  # bit 31 of word 1: token 63
    words[1] = -1
    allowed = np.array(unpack_bitmask(mx.array(words), 40, 70))
    assert allowed.shape == (2, 70)
    assert np.flatnonzero(allowed[0]).tolist() == [3]  # token 63 is past the vocabulary
    assert np.flatnonzero(allowed[1]).tolist() == list(range(40))


def test_constrained_rows_in_a_mixed_batch_on_arrays():
    backend = FakeBackend(vocab_size=40)  # logits have 48 columns: 40..47 are padding
    sampler = BatchSampler(constraint_backend=backend)
    sampled_c = AllowSet({3, 7, 11, 30})
    greedy_c = AllowSet({5, 6})
    everything = AllowSet(range(40))
    sampler.register(0, SamplingParams(temperature=1.0, top_p=0.95), sampled_c)
    sampler.register(1, SamplingParams(temperature=0.8, seed=9))
    sampler.register(2, SamplingParams(), greedy_c)
    sampler.register(3, SamplingParams(), everything)
    sampler.register(4, SamplingParams())
    rng = np.random.default_rng(0)
    previous = None
    history = []
    for _ in range(12):
        logits = rng.normal(size=(5, 48))
        logits[3:, 45] = 50.0  # a padding column the free row may take, the constrained not
        inputs = None if previous is None else mx.array(previous, dtype=mx.uint32)
        tokens = draw(sampler, range(5), normalize(logits), inputs)
        lp = np.array(normalize(logits))
        assert tokens[0] in sampled_c.allowed
        assert tokens[2] == max(greedy_c.allowed, key=lambda t: lp[2, t])
        assert tokens[3] != 45 and tokens[3] == int(np.argmax(lp[3, :40]))
        assert tokens[4] == 45
        history.append(tokens)
        previous = tokens
    # one backend call per step, one packed row per constrained row (batch rows 0, 2, 3)
    assert backend.fills == [[0, 1, 2]] * 12
    assert sampled_c.consumed == [t[0] for t in history[:-1]]
    assert greedy_c.consumed == [t[2] for t in history[:-1]]
    assert sampler.calls == sampler.constrained_calls == 12


class PreferringBackend(FakeBackend):
    """Offers each row's ``opening`` token only as the row's own first choice."""

    def __init__(self, vocab_size: int, openings: dict):
        super().__init__(vocab_size)
        self.openings = openings

    def preferred_tokens(self, rows):
        return [(i, self.openings[id(c)]) for c, i in rows if id(c) in self.openings]


def test_a_preferred_token_is_allowed_only_as_the_rows_first_choice():
    rows = [AllowSet({1, 2}) for _ in range(4)]
    backend = PreferringBackend(vocab_size=16, openings={id(rows[i]): 9 for i in (0, 1, 3)})
    sampler = BatchSampler(constraint_backend=backend)
    for uid, row in enumerate(rows):
        sampler.register(uid, SamplingParams(temperature=0.0 if uid != 3 else 1.0), row)
    logits = np.zeros((4, 16))
    logits[:, 2] = 5.0
    logits[[0, 2, 3], 9] = 9.0  # rows 0, 2 and 3 would open with token 9 unconstrained
    logits[1, 9] = 4.0  # row 1 would not
    logits[3, 9] = 40.0  # sampled, but its first choice by far
    tokens = draw(sampler, range(4), normalize(logits))
    assert tokens[0] == 9  # preferred and offered
    assert tokens[1] == 2  # offered, not preferred: the grammar's best
    assert tokens[2] == 2  # preferred, not offered
    assert tokens[3] == 9


# ------------------------------------------------- the real BatchGenerator


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from mlx_lm import load

    model, tokenizer = load(tiny_model_path)
    return model, tokenizer


class CountingSampler(BatchSampler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rows_per_call: list[int] = []

    def __call__(self, logprobs):
        self.rows_per_call.append(logprobs.shape[0])
        return super().__call__(logprobs)


PROMPT = [11, 12, 13, 14, 15, 16]


def run(model, sampler, requests, *, arrivals=None, max_tokens=12, **kwargs):
    """Generate ``requests`` = [(params, constraint)]; ``arrivals[i]`` = step it is inserted at."""
    generator = make_batch_generator(model, sampler=sampler, **kwargs)
    arrivals = arrivals or [0] * len(requests)
    out: dict[int, list[int]] = {}
    uid_of = {}
    step = 0
    calls_per_step = []
    while len(out) < len(requests) or any(
        len(out.get(i, [])) < max_tokens for i in range(len(requests))
    ):
        for i, (params, constraint) in enumerate(requests):
            if arrivals[i] == step:
                (uid,) = generator.insert([PROMPT], max_tokens=[max_tokens])
                sampler.register(uid, params, constraint)
                uid_of[uid] = i
                out[i] = []
        before = sampler.calls
        _, responses = generator.next()
        calls_per_step.append(sampler.calls - before)
        for r in responses:
            out[uid_of[r.uid]].append(r.token)
            if r.finish_reason is not None:
                sampler.forget(r.uid)
        step += 1
        assert step < 200
    return [out[i] for i in range(len(requests))], calls_per_step, generator


MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, seed=3),
    SamplingParams(temperature=0.8, xtc_probability=0.5),
]


def test_a_mixed_batch_is_sampled_in_one_call_per_step(tiny):
    model, _ = tiny
    sampler = CountingSampler()
    outputs, calls_per_step, generator = run(model, sampler, [(p, None) for p in MIXED])
    assert all(len(o) == 12 for o in outputs)
    assert max(calls_per_step) == 1
    assert sampler.rows_per_call and set(sampler.rows_per_call) == {len(MIXED)}
    assert sampler.registered == 0  # every finished row was forgotten
    assert isinstance(generator._generation_batch, mlx_lm_batches.RowAwareGenerationBatch)


def test_greedy_rows_match_mlx_lm_and_seeded_rows_their_solo_run(tiny):
    from mlx_lm.generate import BatchGenerator

    model, _ = tiny
    plain = BatchGenerator(model)
    (uid,) = plain.insert([PROMPT], max_tokens=[12])
    greedy_alone = []
    while len(greedy_alone) < 12:
        greedy_alone += [r.token for r in plain.next()[1] if r.uid == uid]

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    mx.random.seed(0)
    (seeded_alone,), _, _ = run(model, BatchSampler(), [(seeded, None)])
    mx.random.seed(99)
    (seeded_again,), _, _ = run(model, BatchSampler(), [(seeded, None)])
    mx.random.seed(5)
    mixed, _, _ = run(
        model,
        BatchSampler(),
        [(p, None) for p in MIXED] + [(seeded, None)],
        arrivals=[0, 0, 2, 0, 1, 3, 1],
    )
    assert mixed[0] == greedy_alone
    assert seeded_alone == seeded_again == mixed[-1]


def test_constraints_through_the_batch_generator(tiny):
    model, _ = tiny
    vocab = model.args.vocab_size
    backend = FakeBackend(vocab_size=vocab)
    sampler = CountingSampler(constraint_backend=backend)
    allowed = {40, 41, 97, 120, 300}
    sampled_c, greedy_c, late_c = AllowSet(allowed), AllowSet({7, 8, 9}), AllowSet(allowed)
    requests = [
        (SamplingParams(temperature=1.0), sampled_c),
        (SamplingParams(), None),
        (SamplingParams(), greedy_c),
        (SamplingParams(temperature=0.9, top_p=0.9), None),
        (SamplingParams(temperature=1.2, top_k=50, seed=8), late_c),  # joins a running batch
    ]
    outputs, calls_per_step, _ = run(model, sampler, requests, arrivals=[0, 0, 0, 0, 3])
    free_greedy_alone, _, _ = run(model, BatchSampler(), [(SamplingParams(), None)])
    # One call for the running batch, and one for the first token of the row
    # that joins it (mlx-lm samples a joining prompt batch on its own, greedy too).
    assert calls_per_step.count(2) == 1 and max(calls_per_step) == 2
    for tokens, constraint in [
        (outputs[0], sampled_c),
        (outputs[2], greedy_c),
        (outputs[4], late_c),
    ]:
        assert set(tokens) <= set(constraint.allowed)
        # fed exactly its tokens, in order: each in the step that emits it
        assert constraint.consumed == tokens
    assert outputs[1] == free_greedy_alone[0]
    assert len(backend.fills) == sampler.constrained_calls  # one backend call per step
    assert sampler.constrained_calls == sampler.calls


# ------------------------------------------------------------ internals


def test_mlx_lm_internals_are_what_the_hooks_expect(tiny):
    import mlx_lm
    from mlx_lm.generate import BatchGenerator, GenerationBatch

    model, _ = tiny
    assert mlx_lm.__version__.startswith(mlx_lm_batches.TESTED_MLX_LM)
    mlx_lm_batches.check_internals()
    generator = make_batch_generator(model, sampler=BatchSampler(), prefill_batch_size=2)
    assert isinstance(generator._prompt_batch, mlx_lm_batches.RowAwarePromptBatch)
    # split (through _copy) and extend keep the row-aware classes
    generator.insert([PROMPT, PROMPT[:3], PROMPT + PROMPT], max_tokens=[4, 4, 4])
    kinds = set()
    for _ in range(12):
        generator.next()
        kinds.add((type(generator._prompt_batch), type(generator._generation_batch)))
    assert kinds == {
        (mlx_lm_batches.RowAwarePromptBatch, mlx_lm_batches.RowAwareGenerationBatch)
    }
    split = generator._prompt_batch.split([])
    assert type(split) is mlx_lm_batches.RowAwarePromptBatch
    generator.insert([PROMPT], max_tokens=[4])
    with pytest.raises(ValueError, match="no sequences"):
        mlx_lm_batches.install_row_hooks(generator)
    fresh = BatchGenerator(model)
    assert type(fresh._generation_batch) is GenerationBatch  # what install replaces


def test_the_internals_check_fails_loudly_when_mlx_lm_changes(monkeypatch):
    from mlx_lm.generate import GenerationBatch

    def _step(self, extra):  # a changed signature
        return None

    monkeypatch.setattr(GenerationBatch, "_step", _step)
    with pytest.raises(mlx_lm_batches.MlxLmInternalsChanged, match=r"GenerationBatch._step"):
        mlx_lm_batches.check_internals()
