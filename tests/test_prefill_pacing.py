"""A long prefill does not freeze the sequences that decode: its chunks are paced.

``PrefillPacer`` on its own (what it learns, what chunk it allows), then
``coming_prefill`` against mlx-lm's real ``BatchGenerator`` (it predicts what
``next()`` prefills), then the engine core on the tiny model: a long prompt
that arrives while others decode is prefilled in small chunks, one per
decode step, and every sequence still gets the tokens it gets unpaced.
"""

from __future__ import annotations

import random

import attrs
import pytest
from mlx_lm.generate import BatchGenerator

from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.engine.pacing import (
    DECODE_STEPS,
    FIT_STEPS,
    MIN_CHUNK,
    PACED_STEP_TOKENS,
    PROBE_PAUSE,
    PacedSteps,
    PrefillCostFit,
    PrefillPacer,
    aligned_chunk,
    ladder_tail,
)
from runtime.messages import SamplingParams, Submit
from runtime.mlx_lm_prefill import coming_prefill

SLACK = 1.15  # a floor slack, as --prefill-floor-slack might set it


def test_without_both_estimates_or_anything_decoding_the_chunk_is_full():
    pacer = PrefillPacer(1.5, 2048)
    assert pacer.chunk(decoding=4, prompts=1) == 2048  # nothing learnt yet
    pacer.observe(0.010, decoding=4, prefill_tokens=0)
    assert pacer.decode_seconds == pytest.approx(0.010)
    assert pacer.chunk(decoding=4, prompts=1) == 2048  # no prompt token timed yet
    pacer.observe(0.010 + 0.0001 * 1000, decoding=4, prefill_tokens=1000)
    assert pacer.token_seconds == pytest.approx(0.0001)
    assert pacer.chunk(decoding=0, prompts=1) == 2048  # nobody waits on it
    assert PrefillPacer(0, 2048).chunk(decoding=4, prompts=1) == 2048  # off


def test_the_chunk_takes_about_factor_decode_steps_shared_by_the_prompts():
    pacer = PrefillPacer(1.5, 2048)
    pacer.observe(0.010, decoding=8, prefill_tokens=0)
    pacer.observe(0.0001 * 500, decoding=0, prefill_tokens=500)  # prefill-only steps
    pacer.observe(0.0001 * 1000, decoding=0, prefill_tokens=1000)
    # 1.5 decode steps = 15 ms = 150 tokens at 0.1 ms each: 75 for each of two prompts.
    assert pacer.chunk(decoding=8, prompts=1) == 150
    assert pacer.chunk(decoding=8, prompts=2) == 75
    assert pacer.chunk(decoding=8, prompts=8) == MIN_CHUNK  # never below the floor
    # Fewer decoding than prefilling (a wave whose first prompt is done): no pacing.
    assert pacer.chunk(decoding=1, prompts=7) == 2048
    # A prompt that is short all in all goes whole, however the others are paced.
    assert pacer.chunk(decoding=8, prompts=2, short=300) == 300
    assert pacer.chunk(decoding=8, prompts=2, short=5000) == 2048
    # The decode step is the median of the recent ones.
    pacer.observe(0.020, decoding=8, prefill_tokens=0)
    assert pacer.decode_seconds == pytest.approx(0.015)
    pacer.observe(0.012, decoding=8, prefill_tokens=0)
    assert pacer.decode_seconds == pytest.approx(0.012)


def test_the_budget_follows_the_median_decode_step_not_the_last_few():
    # A GPU's decode step moves between two speeds: mostly 8 ms, lately 12.
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    for seconds in [0.008] * 24 + [0.012] * 8:
        pacer.observe(seconds, decoding=16, prefill_tokens=0)
    assert pacer.decode_seconds == pytest.approx(0.008)
    # Prefill parts of 60 us a token after the 8 ms decode: a budget of 12 ms fits
    # 200 tokens, so 128 on the ladder. A mean pulled towards 12 ms would allow 512
    # (steps of 39 ms, 4.8x the decode step): with 12 ms taken as the decode part, a
    # step's prefill part looks half as long as it is.
    for tokens in (64, 128, 256, 128):
        pacer.observe(0.008 + 0.00006 * tokens, decoding=16, prefill_tokens=tokens)
    assert pacer.chunk(decoding=16, prompts=1) == 128
    # Steps that only decode count as far back as the last DECODE_STEPS of them.
    for _ in range(DECODE_STEPS):
        pacer.observe(0.012, decoding=16, prefill_tokens=0)
    assert pacer.decode_seconds == pytest.approx(0.012)


def test_a_step_s_fixed_cost_is_told_from_its_cost_per_token():
    # At a long context a prefill step costs 20 ms whatever its size, plus 10 us a token
    # (no bound on a paced step's tokens: the fit alone).
    pacer = PrefillPacer(1.5, 2048, step_tokens=None)
    pacer.observe(0.0065, decoding=16, prefill_tokens=0)
    for tokens in (64, 128, 64, 256, 128):
        pacer.observe(0.0065 + 0.020 + 0.00001 * tokens, decoding=16, prefill_tokens=tokens)
    assert pacer.fixed_seconds == pytest.approx(0.020, rel=1e-6)
    assert pacer.token_seconds == pytest.approx(0.00001, rel=1e-6)
    # 1.5 decode steps (9.75 ms) cannot hold the fixed part: the shortest stall, the floor
    # (not a chunk sized as if all of the 20 ms were per token either).
    assert pacer.chunk(decoding=16, prompts=1) == MIN_CHUNK
    assert pacer.chunk(decoding=16, prompts=4) == MIN_CHUNK
    # A larger factor leaves room after the fixed part, (39 ms - 20 ms) / 10 us = 1,900
    # tokens; the chunk grows there by doubling the longest step seen (256) up to that.
    pacer.factor = 6
    assert pacer.chunk(decoding=16, prompts=1) == 512
    pacer.observe(0.0065 + 0.020 + 0.00001 * 512, decoding=16, prefill_tokens=512)
    assert pacer.chunk(decoding=16, prompts=1) == 1024
    pacer.observe(0.0065 + 0.020 + 0.00001 * 1024, decoding=16, prefill_tokens=1024)
    assert pacer.chunk(decoding=16, prompts=1) == pytest.approx(1900, abs=1)


def test_a_line_with_no_slope_does_not_let_the_chunk_jump_to_a_full_one():
    # Steps of 64 to 256 tokens all took the fixed part's time (a shared pass at a long
    # context): the line's slope is near zero and would allow any chunk.
    for bound, one, two in ((None, 512, 256), (PACED_STEP_TOKENS, 256, 128)):
        pacer = PrefillPacer(1.5, 2048, ladder=True, step_tokens=bound)
        pacer.observe(0.011, decoding=16, prefill_tokens=0)
        for tokens in (64, 128, 64, 256, 128, 64):
            pacer.observe(0.011 + 0.016 + 1e-9 * tokens, decoding=16, prefill_tokens=tokens)
        # Twice the longest step seen, and no more than a paced step's tokens.
        assert pacer.chunk(decoding=16, prompts=1) == one
        assert pacer.chunk(decoding=16, prompts=2) == two


def test_on_the_ladder_a_short_prompt_pads_to_a_multiple_of_the_floor():
    # A short prompt (79 tokens) joins a long one's paced prefill: the step covers it
    # whole, and the long one's chunk stays a multiple of 64 (so are its keys).
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    for tokens in (64, 128, 64, 128):
        pacer.observe(0.010 + 0.0135 + 1e-5 * tokens, decoding=16, prefill_tokens=tokens)
    assert pacer.chunk(decoding=16, prompts=2) == 64
    assert pacer.chunk(decoding=16, prompts=2, short=79) == 128
    assert pacer.chunk(decoding=16, prompts=2, short=64) == 64
    assert pacer.chunk(decoding=16, prompts=1, short=600) == 640
    off_ladder = PrefillPacer(1.5, 2048)
    off_ladder.observe(0.010, decoding=16, prefill_tokens=0)
    for tokens in (64, 128, 64, 128):
        off_ladder.observe(0.0235 + 1e-5 * tokens, decoding=16, prefill_tokens=tokens)
    assert off_ladder.chunk(decoding=16, prompts=2, short=79) == 79


def test_a_small_fixed_cost_leaves_the_budget_to_the_tokens():
    pacer = PrefillPacer(1.5, 2048, step_tokens=None)
    pacer.observe(0.010, decoding=8, prefill_tokens=0)
    for tokens in (100, 300, 200, 400):
        pacer.observe(0.010 + 0.003 + 0.00002 * tokens, decoding=8, prefill_tokens=tokens)
    # (15 ms - 3 ms) / 20 us = 600 tokens.
    assert pacer.chunk(decoding=8, prompts=1) == pytest.approx(600, abs=1)


def test_steps_of_one_size_learn_the_line_from_a_step_of_half_that_size():
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    for _ in range(3):  # 256 tokens: 5 ms fixed, 30 us a token
        pacer.observe(0.010 + 0.005 + 0.00003 * 256, decoding=16, prefill_tokens=256)
    # One size seen: the line is a proportion (all the cost on the tokens). The next
    # step is half as long instead of twice, so the second point costs no longer stall.
    assert pacer.fixed_seconds == 0.0
    assert pacer.chunk(decoding=16, prompts=1) == 128
    pacer.observe(0.010 + 0.005 + 0.00003 * 128, decoding=16, prefill_tokens=128)
    assert pacer.fixed_seconds == pytest.approx(0.005, rel=1e-6)
    # Two sizes: (15 ms - 5 ms) / 30 us = 333 tokens, 256 on the ladder.
    assert pacer.chunk(decoding=16, prompts=1) == 256


def test_steps_of_one_size_at_the_floor_learn_the_line_from_one_of_twice_it():
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.0065, decoding=16, prefill_tokens=0)
    pacer.observe(0.0065 + 0.0095, decoding=16, prefill_tokens=64)
    # One size seen: the line is a proportion, which alone would keep the floor for good.
    # The floor's step fits the 9.75 ms budget, so a larger one might: twice it.
    assert pacer.fixed_seconds == 0.0
    assert pacer.chunk(decoding=16, prompts=1) == 128
    pacer.observe(0.0065 + 0.010, decoding=16, prefill_tokens=128)
    # Two sizes: nearly all of it is fixed.
    assert pacer.fixed_seconds == pytest.approx(0.009, rel=0.05)


def test_floor_steps_longer_than_the_budget_are_not_probed_with_larger_ones():
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.0065, decoding=16, prefill_tokens=0)
    for _ in range(40):  # a long context: the floor alone takes 30 ms of a 9.75 ms budget
        pacer.observe(0.0065 + 0.030, decoding=16, prefill_tokens=MIN_CHUNK)
        assert pacer.chunk(decoding=16, prompts=1) == MIN_CHUNK
    # A new, short prompt: its floor steps fit again, and a step of twice it probes.
    for _ in range(FIT_STEPS):
        pacer.observe(0.0065 + 0.009, decoding=16, prefill_tokens=MIN_CHUNK)
    assert pacer.chunk(decoding=16, prompts=1) == 2 * MIN_CHUNK


def test_with_a_floor_slack_floor_steps_longer_than_the_budget_are_probed_once_a_pause():
    # A long context on a CPU: the floor alone takes 30 ms of a 9.75 ms budget, and twice
    # the tokens twice the time, so a longer chunk never pays.
    pacer = PrefillPacer(1.5, 2048, ladder=True, floor_slack=SLACK)
    pacer.observe(0.0065, decoding=16, prefill_tokens=0)
    pacer.observe(0.0065 + 0.030, decoding=16, prefill_tokens=MIN_CHUNK)
    chunks = []
    for _ in range(3 * PROBE_PAUSE):
        # Asked twice a step, as the engine's hook asks (before and after sizing a group).
        chunk = min(pacer.chunk(decoding=16, prompts=1), pacer.chunk(decoding=16, prompts=1))
        chunks.append(chunk)
        pacer.observe(0.0065 + 0.030 * chunk / MIN_CHUNK, decoding=16, prefill_tokens=chunk)
    probes = [i for i, chunk in enumerate(chunks) if chunk != MIN_CHUNK]
    assert all(chunks[i] == 2 * MIN_CHUNK for i in probes)
    assert probes[0] == 0 and len(probes) == 3
    assert all(b - a >= PROBE_PAUSE for a, b in zip(probes, probes[1:], strict=False))
    # A new, short prompt: its floor steps fit again, and a step of twice it probes at once.
    for _ in range(FIT_STEPS):
        pacer.observe(0.0065 + 0.009, decoding=16, prefill_tokens=MIN_CHUNK)
    assert pacer.chunk(decoding=16, prompts=1) == 2 * MIN_CHUNK


def test_with_a_floor_slack_the_chunk_grows_where_a_longer_one_costs_little_more():
    # A long context on a GPU beside a 10 ms decode step: 64 tokens take 18 ms more, 128
    # take 16, 256 take 17 and 512 take 40 (a longer chunk's attention leaves its fast
    # path). The floor cannot meet the 15 ms budget, so the chunk grows while a step
    # stays within the slack of the floor's (1.15 x 18 = 20.7 ms).
    extra = {64: 0.018, 128: 0.016, 256: 0.017, 512: 0.040}
    pacer = PrefillPacer(1.5, 2048, ladder=True, floor_slack=SLACK, step_tokens=None)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    pacer.observe(0.010 + extra[64], decoding=16, prefill_tokens=64)
    chunks = []
    for _ in range(4 * PROBE_PAUSE):
        chunk = min(pacer.chunk(decoding=16, prompts=1), pacer.chunk(decoding=16, prompts=1))
        chunks.append(chunk)
        pacer.observe(0.010 + extra[chunk], decoding=16, prefill_tokens=chunk)
    assert chunks[:4] == [128, 256, 512, 256]
    assert chunks.count(256) > 0.9 * len(chunks)
    # 512 cost more than the slack: probed again only after a pause; nothing beyond it.
    assert chunks.count(512) <= len(chunks) // PROBE_PAUSE + 1 and max(chunks) == 512


def test_with_a_floor_slack_no_probe_where_each_doubling_costs_more():
    # 64 tokens 18 ms, 128 tokens 20 (within the slack of 20.7 ms): a step's cost grows
    # with its tokens, and 256 would cost about 22.2, so it is not tried.
    extra = {64: 0.018, 128: 0.020, 256: 0.030}
    pacer = PrefillPacer(1.5, 2048, ladder=True, floor_slack=SLACK)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    pacer.observe(0.010 + extra[64], decoding=16, prefill_tokens=64)
    chunks = []
    for _ in range(PROBE_PAUSE):
        chunk = pacer.chunk(decoding=16, prompts=1)
        chunks.append(chunk)
        pacer.observe(0.010 + extra[chunk], decoding=16, prefill_tokens=chunk)
    assert 256 not in chunks and chunks.count(128) > 0.9 * len(chunks)


def test_the_fit_without_spread_puts_all_the_cost_on_the_tokens():
    fit = PrefillCostFit()
    assert fit.line() is None
    fit.add(500, 0.05)
    fit.add(500, 0.05)
    fixed, per_token, spread = fit.line()
    assert (fixed, spread) == (0.0, False) and per_token == pytest.approx(0.0001)


def paced_chunks(fixed: float, per_token: float, steps: int = 80,
                 floor_slack: float = 0.0, step_tokens: int | None = None) -> list[int]:
    """The chunks a pacer picks, step after step, against a prefill that costs ``fixed``
    plus ``per_token`` a token beside an 8 ms decode step; each step's time off by up
    to 20 %, and every seventh step five times long (a new attention shape); with no
    bound on a paced step's tokens unless ``step_tokens``."""
    rng = random.Random(0)
    pacer = PrefillPacer(1.5, 2048, ladder=bool(floor_slack), floor_slack=floor_slack,
                         step_tokens=step_tokens)
    for _ in range(5):
        pacer.observe(0.008, decoding=16, prefill_tokens=0)
    chunks = []
    for step in range(steps):
        chunk = pacer.chunk(decoding=16, prompts=1)
        prefill = (fixed + per_token * chunk) * rng.uniform(0.8, 1.2) * (5 if step % 7 == 6 else 1)
        pacer.observe(0.008 + prefill, decoding=16, prefill_tokens=chunk)
        chunks.append(chunk)
    return chunks


def test_the_pacer_settles_on_the_budget_when_the_fixed_part_fits_in_it():
    # 12 ms of budget, 2 ms fixed, 20 us a token: 500 tokens a step.
    settled = sorted(paced_chunks(0.002, 0.00002)[-30:])
    assert 350 <= settled[len(settled) // 2] <= 700


def test_a_paced_step_takes_no_more_than_its_tokens_however_cheap_the_line_says_they_are():
    # The budget would allow 500 tokens; a paced step takes PACED_STEP_TOKENS at most,
    # all its prompts' chunks together, and never less than the floor.
    chunks = paced_chunks(0.002, 0.00002, step_tokens=PACED_STEP_TOKENS)[-30:]
    assert max(chunks) == PACED_STEP_TOKENS
    assert sorted(chunks)[len(chunks) // 2] == PACED_STEP_TOKENS
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    for tokens in (64, 128, 256, 512, 1024):  # cheap: 1 ms fixed, 2 us a token
        pacer.observe(0.010 + 0.001 + 0.000002 * tokens, decoding=16, prefill_tokens=tokens)
    assert pacer.chunk(decoding=16, prompts=1) == PACED_STEP_TOKENS
    assert pacer.chunk(decoding=16, prompts=2) == PACED_STEP_TOKENS // 2
    assert pacer.chunk(decoding=16, prompts=8) == MIN_CHUNK
    # Nothing decoding: a prompt's full chunk, as mlx-lm takes it.
    assert pacer.chunk(decoding=0, prompts=1) == 2048


def test_the_pacer_keeps_to_the_floor_when_the_fixed_part_outgrows_the_budget():
    # 20 ms fixed, more than the 12 ms budget: the floor, but for the steps of
    # another size that keep the fit's line.
    chunks = paced_chunks(0.020, 0.00002)[-30:]
    assert sorted(chunks)[len(chunks) // 2] == MIN_CHUNK
    assert max(chunks) <= 2 * MIN_CHUNK


def test_with_a_floor_slack_the_chunk_grows_while_a_step_costs_little_more_than_the_floor():
    # The same steps on the ladder with a floor slack of 1.25: the floor's take 21.3 ms,
    # 128 tokens 22.6 and 256 tokens 25.1 (within the slack of the floor's, though a
    # step's noise may put 256 past it), 512 tokens 30.2 (not).
    chunks = paced_chunks(0.020, 0.00002, steps=260, floor_slack=1.25)[-150:]
    assert 128 <= sorted(chunks)[len(chunks) // 2] <= 256
    assert max(chunks) <= 512


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from mlx_lm import load

    return load(tiny_model_path)[0]


def test_coming_prefill_predicts_what_next_prefills(model):
    gen = BatchGenerator(model, max_tokens=4, prefill_batch_size=2, prefill_step_size=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 400) for _ in range(n)] for n in (300, 50, 20)]
    gen.insert(prompts)
    seen: dict[int, int] = {}
    for _ in range(12):
        decoding, n, padded, short, depth = coming_prefill(gen, 100)
        # The prompt batch's keys: its longest member's prefilled tokens.
        assert depth == max((seen.get(uid, 0) for uid in gen._prompt_batch.uids), default=0)
        # The 20- and 50-token prompts are short: their next segments, whole.
        lefts = [len(m[0][0]) for m in gen._currently_processing
                 if m[2] - 1 <= 100 and not (len(m[0]) == 1 and len(m[0][0]) == 1)]
        expected = {}
        for i, m in enumerate(gen._currently_processing):
            if not (len(m[0]) == 1 and len(m[0][0]) == 1):
                expected[gen._prompt_batch.uids[i]] = min(len(m[0][0]), 64)
        prompt_responses, _ = gen.next()
        done = {r.uid: r.progress[0] for r in prompt_responses if not r.end_of_prompt}
        chunks = {uid: d - seen.get(uid, 0) for uid, d in done.items()}
        seen.update(done)
        # Members already in the batch go as predicted; joiners are counted in n.
        for uid, chunk in expected.items():
            if uid in chunks:
                assert chunks[uid] == chunk
        assert n == len(chunks)
        assert padded == n * max(chunks.values(), default=0)
        assert short >= max(lefts, default=0)
    assert decoding >= 0


def submits(vocab: int) -> list[Submit]:
    rng = random.Random(3)

    def make(i, n, max_tokens):
        prompt = tuple(rng.randrange(10, vocab - 10) for _ in range(n))
        return Submit(request_id=i, prompt=prompt, segments=(prompt,), segment_types=("user",),
                      max_tokens=max_tokens, sampling=SamplingParams())

    return [make(1, 12, 40), make(2, 15, 40), make(3, 1200, 4)]


def drive(core, subs) -> tuple[dict[int, list[int]], list[int]]:
    """Start the two short ones, let them decode, then the long one; its chunks while
    they decode, and every request's tokens."""
    tokens: dict[int, list[int]] = {s.request_id: [] for s in subs}
    long_chunks, done = [], 0
    for s in subs[:2]:
        core.handle_command(s)
    for step in range(400):
        if step == 4:
            core.handle_command(subs[2])
        out = core.step()
        for p in out.progress:
            if p.request_id == 3 and p.done > done:
                long_chunks.append(p.done - done)
                done = p.done
        for e in out.tokens:
            tokens[e.request_id].append(e.token)
        if step > 4 and not core.has_work:
            return tokens, long_chunks
    raise AssertionError("the engine did not finish")


def test_the_pacer_s_factor_is_the_device_s_default_unless_set(tiny_model_path):
    """Unset, the factor is the one for the device the engine runs on (the CPU here);
    a value given wins."""
    from runtime.engine.pacing import STALL_FACTOR, STALL_FACTOR_CUDA

    assert STALL_FACTOR_CUDA < STALL_FACTOR
    plain = make_engine_core(ServerConfig(model=tiny_model_path), tiny_model_path)
    assert plain._paced.pacer.factor == STALL_FACTOR
    given = ServerConfig(model=tiny_model_path, decode_stall_factor=STALL_FACTOR_CUDA)
    assert make_engine_core(given, tiny_model_path)._paced.pacer.factor == STALL_FACTOR_CUDA


def test_the_pacing_defaults_are_settings_left_unset_and_differ_on_cuda(tiny_model_path):
    """Each default ``pacing_defaults`` gives names a setting that is unset unless given
    (so that the device's default applies), and CUDA's differ from the others'."""
    from runtime.engine.pacing import pacing_defaults

    unset = ServerConfig(model=tiny_model_path)
    cuda, elsewhere = pacing_defaults(True), pacing_defaults(False)
    assert cuda.keys() == elsewhere.keys()
    assert all(getattr(unset, name) is None for name in cuda)
    assert all(cuda[name] != elsewhere[name] for name in cuda)


def test_a_paced_chunk_s_parts_are_the_device_s_default_unless_set(tiny_model_path):
    """Unset, a lone prompt's paced chunk spreads over the steps the engine's device
    takes by default (the CPU here: one); a value given wins."""
    from runtime.engine.pacing import CHUNK_PARTS, CHUNK_PARTS_CUDA
    from runtime.mixed_step import MixedStepModel

    def parts(core) -> int:
        mixer = core._batch._prompt_batch.model
        assert isinstance(mixer, MixedStepModel)
        return mixer.chunk_parts

    assert CHUNK_PARTS < CHUNK_PARTS_CUDA
    plain = make_engine_core(ServerConfig(model=tiny_model_path), tiny_model_path)
    assert parts(plain) == CHUNK_PARTS
    given = ServerConfig(model=tiny_model_path, prefill_chunk_parts=CHUNK_PARTS_CUDA)
    assert parts(make_engine_core(given, tiny_model_path)) == CHUNK_PARTS_CUDA


def test_a_long_prompt_is_prefilled_in_paced_chunks_with_the_same_tokens(tiny_model_path):
    cores = {}
    for factor in (0, 1.5):
        config = ServerConfig(model=tiny_model_path, decode_stall_factor=factor,
                              admission_window_ms=0, prefill_step_size=512)
        cores[factor] = make_engine_core(config, tiny_model_path)
    paced = cores[1.5]._paced
    assert isinstance(paced, PacedSteps) and cores[0]._paced is None
    # Seed the estimates so that this CPU's timings do not decide the chunk:
    # a decode step 10 ms, a prompt token 0.2 ms: 1.5 steps are 75 tokens, and the
    # ladder's step below that (the chunk's pass shared with the decode) is 64.
    paced.pacer.decode_seconds, paced.pacer.token_seconds = 0.010, 0.0002
    paced.pacer.observe = lambda *a, **k: None
    results = {f: drive(core, submits(core.handle.info.vocab_size)) for f, core in cores.items()}
    (plain_tokens, plain_chunks), (paced_tokens, paced_chunks) = results[0], results[1.5]
    assert plain_chunks[0] == 512  # mlx-lm's full chunk, though two decode
    assert max(paced_chunks) == 64 and len(paced_chunks) > len(plain_chunks)
    assert sum(paced_chunks) == sum(plain_chunks)
    assert paced_tokens == plain_tokens
    assert cores[1.5]._batch._generation_batch.model.mixed_passes > 0


def test_the_floor_slack_reaches_the_pacer_where_chunks_are_on_the_ladder(tiny_model_path):
    for chunk_pass, slack in (("shared", 1.15), ("separate", 0.0)):
        config = ServerConfig(model=tiny_model_path, prefill_floor_slack=1.15,
                              chunk_pass=chunk_pass, admission_window_ms=0)
        pacer = make_engine_core(config, tiny_model_path)._paced.pacer
        assert (pacer.ladder, pacer.floor_slack) == (chunk_pass == "shared", slack)
    default = ServerConfig(model=tiny_model_path, admission_window_ms=0)
    assert make_engine_core(default, tiny_model_path)._paced.pacer.floor_slack == 0


def test_pacing_that_cannot_read_the_generator_turns_itself_off():
    def broken(generator, short):
        raise AttributeError("_currently_processing")

    class Generator:
        prefill_step_size = 100

    grouped = []
    paced = PacedSteps(PrefillPacer(1.5, 2048), broken)
    generator = Generator()
    paced.before(generator, grouped.append)
    assert paced.pacer.factor == 0 and generator.prefill_step_size == 2048
    paced.before(generator, grouped.append)  # off: the group's sizing alone
    paced.after(0.01)
    assert grouped == [generator]


def test_a_paced_chunk_keeps_within_its_bound_and_never_below_the_floor():
    pacer = PrefillPacer(1.5, 2048, ladder=True, step_tokens=None)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    for tokens in (64, 128, 256, 512, 1024):  # cheap: 1 ms fixed, 2 us a token
        pacer.observe(0.010 + 0.001 + 0.000002 * tokens, decoding=16, prefill_tokens=tokens)
    assert pacer.chunk(decoding=16, prompts=1) == 2048
    assert pacer.chunk(decoding=16, prompts=1, most=400) == 256  # on the ladder below it
    assert pacer.chunk(decoding=16, prompts=1, most=10) == MIN_CHUNK


def test_paced_steps_ask_the_bound_for_the_coming_prompts_and_their_depth():
    from types import SimpleNamespace

    from runtime.mlx_lm_prefill import ComingPrefill

    asked = []
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    for tokens in (256, 512):
        pacer.observe(0.010 + 0.001 + 0.000002 * tokens, decoding=16, prefill_tokens=tokens)
    coming = ComingPrefill(decoding=16, prompts=1, tokens=1024, short=0, depth=20_000)
    paced = PacedSteps(pacer, lambda generator, short: coming,
                       chunk_limit=lambda rows, prefix: asked.append((rows, prefix)) or 300)
    generator = SimpleNamespace(prefill_step_size=2048)
    paced.before(generator)
    assert generator.prefill_step_size == 256
    assert asked and set(asked) == {(1, 20_000)}


def test_in_the_engine_no_chunk_s_rest_runs_as_a_pass_of_its_own(tiny_model_path,
                                                                  monkeypatch):
    """With a paced chunk over two steps, a long prompt of two segments beside decoding
    rows: every chunk's later layers ride the next step's decode pass. None is left in
    flight where its segment's end is stored (which would run its rest as a second pass
    in the same step), and the tokens are those of one pass a chunk."""
    from runtime.mixed_step import MixedStepModel

    rests = []  # the tokens of each chunk whose rest ran as a pass of its own
    real_settle = MixedStepModel.settle

    def settle(mixer):
        if mixer.chunk_in_flight:
            rests.append(mixer.chunk_in_flight)
        real_settle(mixer)

    monkeypatch.setattr(MixedStepModel, "settle", settle)

    def tokens_and_carrying_steps(parts: int) -> tuple[dict, int]:
        config = ServerConfig(model=tiny_model_path, decode_stall_factor=1.5,
                              admission_window_ms=0, prefill_step_size=512,
                              prefill_chunk_parts=parts)
        core = make_engine_core(config, tiny_model_path)
        core._paced.pacer.decode_seconds, core._paced.pacer.token_seconds = 0.010, 0.0002
        core._paced.pacer.observe = lambda *a, **k: None
        subs = submits(core.handle.info.vocab_size)
        prompt = subs[2].prompt
        subs[2] = attrs.evolve(subs[2], segments=(prompt[:700], prompt[700:]),
                               segment_types=("system", "user"))
        carried, real_step = [], core.step

        def step():
            out = real_step()
            carried.append(bool(core._batch.chunk_in_flight()))
            return out

        core.step = step
        return drive(core, subs)[0], sum(carried)

    results = {parts: tokens_and_carrying_steps(parts) for parts in (1, 2)}
    assert results[2][0] == results[1][0]
    assert results[1][1] == 0 and results[2][1] > 0
    assert rests == []


def test_a_chunk_spread_over_steps_is_observed_once_at_its_slowest_step():
    """A chunk whose layers go on in the next steps (``--prefill-chunk-parts``): the
    steps that carry them prefill no new tokens, and the pacer sees the chunk as one
    step of its tokens that took as long as its slowest part."""
    from types import SimpleNamespace

    from runtime.mlx_lm_prefill import ComingPrefill

    observed = []
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe = lambda seconds, **step: observed.append((seconds, step))
    coming = ComingPrefill(decoding=16, prompts=1, tokens=128, short=0, depth=8_000)
    in_flight = []  # the tokens of a chunk in flight after each step
    generator = SimpleNamespace(prefill_step_size=2048, _generation_batch=[0] * 16,
                                chunk_in_flight=lambda: in_flight[0] if in_flight else 0)
    paced = PacedSteps(pacer, lambda generator, short: coming)
    for seconds, after in ((0.018, 128), (0.025, 128), (0.016, 0), (0.020, 0)):
        paced.before(generator)
        in_flight[:] = [after]
        paced.after(seconds)
    assert observed == [(0.025, {"decoding": 16, "prefill_tokens": 128}),
                        (0.020, {"decoding": 16, "prefill_tokens": 128})]


@pytest.mark.parametrize("chunk,segment,expected", [
    (256, 189, 128),  # 189 would pad by 67 onto 256: 128, then 61 padded onto 64
    (256, 129, 128),
    (256, 192, 128),
    (256, 193, 256),  # pads by 63 onto 256: one shared pass
    (256, 100, 256),  # onto 128
    (256, 256, 256),
    (256, 300, 256),  # not the segment's last chunk
    (256, 61, 256),
    (128, 189, 128),
    (512, 320, 256),
])
def test_a_lone_prompt_s_last_paced_chunk_leaves_a_rest_that_pads_onto_the_ladder(
        chunk, segment, expected):
    assert ladder_tail(chunk, segment) == expected


def test_every_step_of_a_segment_s_end_is_a_length_a_shared_pass_takes():
    """Whatever the paced chunk and the tokens left, each step to the segment's end is on
    the ladder or fewer than 64 tokens short of its next length."""
    from runtime.mixed_step import LADDER_FLOOR, on_ladder

    def padded_onto_ladder(tokens: int) -> bool:
        length = LADDER_FLOOR
        while length < tokens:
            length *= 2
        return on_ladder(tokens) or length - tokens < LADDER_FLOOR

    for chunk in (64, 128, 256):
        for left in range(1, 700):
            while left:
                step = min(ladder_tail(chunk, left), left)
                assert step == chunk or padded_onto_ladder(step), (chunk, left, step)
                left -= step


def test_paced_steps_cut_a_lone_prompt_s_last_chunk_only_while_pacing_a_long_one():
    from types import SimpleNamespace

    from runtime.mlx_lm_prefill import ComingPrefill, LonePrompt

    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.010, decoding=16, prefill_tokens=0)
    for tokens in (128, 256):
        pacer.observe(0.010 + 0.001 + 0.000002 * tokens, decoding=16, prefill_tokens=tokens)
    lone = [LonePrompt(prefix=29_824, segment=189)]
    cases = [
        (ComingPrefill(decoding=16, prompts=1, tokens=256, short=0, depth=29_824), 128),
        # a short prompt goes in one step; with nothing decoding chunks are full
        (ComingPrefill(decoding=16, prompts=1, tokens=256, short=189, depth=29_824), 256),
        (ComingPrefill(decoding=0, prompts=1, tokens=189, short=0, depth=29_824), 2048),
    ]
    for coming, expected in cases:
        paced = PacedSteps(pacer, lambda generator, short, coming=coming: coming,
                           tail=lambda g: lone[0])
        generator = SimpleNamespace(prefill_step_size=2048)
        paced.before(generator)
        assert generator.prefill_step_size == expected, coming
    # Several prompts (no lone one), or a pacer off its ladder: as it comes.
    coming = cases[0][0]
    for tail, ladder in ((lambda g: None, True), (lambda g: lone[0], False)):
        paced = PacedSteps(PrefillPacer(1.5, 2048, ladder=ladder),
                           lambda generator, short: coming, tail=tail)
        paced.pacer.observe(0.010, decoding=16, prefill_tokens=0)
        for tokens in (128, 256):
            paced.pacer.observe(0.011 + 0.000002 * tokens, decoding=16, prefill_tokens=tokens)
        generator = SimpleNamespace(prefill_step_size=2048)
        paced.before(generator)
        assert generator.prefill_step_size == 256


@pytest.mark.parametrize("chunk,prefix,segment,expected", [
    (2048, 2176, 28_000, 1920),  # after a paced start: back to the grid, then full chunks
    (2048, 12_000, 20_000, 288),  # after a cached prefix of 12,000 tokens
    (2048, 4096, 28_000, 2048),  # on the grid already
    (2048, 12_000, 2048, 2048),  # a segment of one chunk goes in one step either way
    (256, 12_000, 20_000, 256),  # a paced chunk is the pacer's
])
def test_a_lone_prompt_s_full_chunk_is_cut_back_to_the_grid(chunk, prefix, segment, expected):
    assert aligned_chunk(chunk, 2048, prefix=prefix, segment=segment) == expected


def test_paced_steps_keep_a_lone_prompt_on_the_grid_with_pacing_on_or_off():
    """With a ``lone`` reader, a lone prompt off the grid gets the cut in the step its
    chunk would be full, whether the pacer is on (nothing decoding) or off; the next
    step's chunk is full again once it is back on the grid."""
    from types import SimpleNamespace

    from runtime.mlx_lm_prefill import ComingPrefill, LonePrompt

    coming = ComingPrefill(decoding=0, prompts=1, tokens=2048, short=0, depth=2176)
    lone = [LonePrompt(prefix=2176, segment=27_000)]
    for factor in (1.5, 0):
        pacer = PrefillPacer(factor, 2048, ladder=True)
        lone[0] = LonePrompt(prefix=2176, segment=27_000)
        paced = PacedSteps(pacer, lambda generator, short: coming, lone=lambda g: lone[0])
        generator = SimpleNamespace(prefill_step_size=64)  # a paced chunk before
        paced.before(generator)
        assert generator.prefill_step_size == 1920
        lone[0] = LonePrompt(prefix=4096, segment=25_080)
        paced.before(generator)
        assert generator.prefill_step_size == 2048
        lone[0] = None  # several prompts, or none
        paced.before(generator)
        assert generator.prefill_step_size == 2048
    unaligned = PacedSteps(PrefillPacer(1.5, 2048), lambda generator, short: coming)
    generator = SimpleNamespace(prefill_step_size=2048)
    unaligned.before(generator)
    assert generator.prefill_step_size == 2048


def _prefix_cache(model, tokens):
    """A single-sequence KV cache holding ``tokens``, as a prompt-cache entry is."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_lone_prompt_reads_a_member_s_keys_and_a_joiner_s_cached_prefix(model):
    """``lone_prompt`` against mlx-lm's ``BatchGenerator``: a joiner's cached prefix and
    segment, then, once it is a member, its keys as they grow; none while two prompts
    prefill."""
    from runtime.mlx_lm_batches import install_row_hooks
    from runtime.mlx_lm_prefill import lone_prompt

    rng = random.Random(5)
    prefix = [rng.randrange(10, 400) for _ in range(37)]
    rest = [rng.randrange(10, 400) for _ in range(150)]
    gen = install_row_hooks(BatchGenerator(model, max_tokens=2, prefill_batch_size=2,
                                           prefill_step_size=64))
    gen.insert([rest], caches=[_prefix_cache(model, prefix)])
    # mlx-lm gives the last token a segment of its own: 149 tokens are the first's.
    assert tuple(lone_prompt(gen)) == (37, 149)
    gen.next()
    assert tuple(lone_prompt(gen)) == (37 + 64, 149 - 64)
    gen.insert([[rng.randrange(10, 400) for _ in range(100)]])
    assert lone_prompt(gen) is None  # a second prompt joins


def test_a_lone_prompt_after_a_cached_prefix_is_prefilled_on_the_grid_with_the_same_tokens(model):
    """A prompt after a cached prefix off the grid: with the pacer's ``lone`` reader its
    first chunk ends on the grid and every later one is full, and the sequence's tokens
    are the ones it gets with mlx-lm's chunks."""
    from runtime.mlx_lm_batches import install_row_hooks
    from runtime.mlx_lm_prefill import lone_prompt

    rng = random.Random(6)
    prefix = [rng.randrange(10, 400) for _ in range(37)]
    rest = [rng.randrange(10, 400) for _ in range(300)]
    runs = {}
    for name, lone in (("mlx-lm", None), ("grid", lone_prompt)):
        gen = install_row_hooks(BatchGenerator(model, max_tokens=6, prefill_step_size=64))
        paced = PacedSteps(PrefillPacer(0, 64), coming_prefill, lone=lone)
        gen.insert([rest], caches=[_prefix_cache(model, prefix)])
        chunks, tokens, done = [], [], 0
        for _ in range(40):
            paced.before(gen)
            prompt_responses, generation_responses = gen.next()
            for r in prompt_responses:
                if r.progress[0] > done:
                    chunks.append(r.progress[0] - done)
                    done = r.progress[0]
            tokens += [r.token for r in generation_responses]
            if len(tokens) == 6:
                break
        runs[name] = chunks, tokens
    (plain, plain_tokens), (grid, grid_tokens) = runs["mlx-lm"], runs["grid"]
    assert plain[:4] == [64, 64, 64, 64]
    assert grid[0] == 64 - 37 and grid[1:4] == [64, 64, 64]
    assert all((37 + sum(grid[:i + 1])) % 64 == 0 for i in range(4))
    assert sum(grid) == sum(plain) == 300
    assert grid_tokens == plain_tokens and len(grid_tokens) == 6


def test_lone_prompt_counts_a_member_s_own_keys_beside_one_that_is_done(model):
    """A prompt that joined another one step in (padded to its keys): in the step where
    the first is done (it leaves for decoding), the second is the lone prompt, its keys
    its own tokens, not the batch's padded length."""
    from runtime.mlx_lm_batches import install_row_hooks
    from runtime.mlx_lm_prefill import lone_prompt

    rng = random.Random(7)
    gen = install_row_hooks(BatchGenerator(model, max_tokens=2, prefill_batch_size=2,
                                           prefill_step_size=64))
    first = gen.insert([[rng.randrange(10, 400) for _ in range(200)]])[0]
    gen.next()
    second = gen.insert([[rng.randrange(10, 400) for _ in range(300)]])[0]
    done = {}
    checked = 0
    for _ in range(12):
        members = gen._currently_processing
        finished = [len(m[0]) == 1 and len(m[0][0]) == 1 for m in members]
        if any(finished) and not all(finished):
            lone = lone_prompt(gen)
            assert lone is not None and lone.prefix == done[second] and first in done
            checked += 1
        prompt_responses, _ = gen.next()
        done.update((r.uid, r.progress[0]) for r in prompt_responses)
    assert checked


def test_chunks_are_kept_on_the_grid_only_where_the_prefill_attention_is_installed(
        tiny_model_path, monkeypatch):
    """On the CPU (no prefill attention of ours) chunks and groups come as they do; where
    it is installed (CUDA), the pacer keeps a lone prompt's chunks on the grid, even with
    pacing off, and prompts of more than two full chunks are prefilled alone."""
    import runtime.engine.loading as loading
    from runtime.mlx_lm_prefill import lone_prompt

    plain = ServerConfig(model=tiny_model_path, admission_window_ms=0, prefill_step_size=256)
    core = make_engine_core(plain, tiny_model_path)
    assert core._paced._lone is None and core._prefill_group.keywords["alone_from"] is None
    assert core._paced._tail is None  # on a GPU, a segment's last paced chunk (below)
    monkeypatch.setattr(loading, "install_prefill_attention", lambda mx, full_chunk: True)
    for factor in (1.5, 0):
        config = ServerConfig(model=tiny_model_path, admission_window_ms=0,
                              decode_stall_factor=factor, prefill_step_size=256)
        core = make_engine_core(config, tiny_model_path)
        assert core._paced._lone is lone_prompt and core._paced.pacer.factor == factor
        assert core._prefill_group.keywords["alone_from"] == 512
    monkeypatch.setattr(loading, "passes_cost_steps", lambda mx: True)
    core = make_engine_core(plain, tiny_model_path)
    assert core._paced._tail is lone_prompt


@pytest.mark.parametrize(("setting", "bound"), [(256, 256), (1024, 1024), (0, None)])
def test_the_engine_s_pacer_takes_its_step_tokens_from_the_settings(tiny_model_path, setting,
                                                                    bound):
    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core

    core = make_engine_core(ServerConfig(model=tiny_model_path, paced_step_tokens=setting),
                            tiny_model_path)
    assert core._paced.pacer.step_tokens == bound


def test_a_bound_below_the_floor_s_double_keeps_the_second_point_within_it():
    # Only floor-sized steps seen, all within the budget: the pacer would try twice the
    # floor for the line's second point, but a bound of 100 tokens allows the floor only
    # (on the ladder); off the ladder, the bound itself.
    for ladder, expected in ((True, MIN_CHUNK), (False, 100)):
        pacer = PrefillPacer(1.5, 2048, ladder=ladder, step_tokens=100)
        pacer.observe(0.010, decoding=16, prefill_tokens=0)
        for _ in range(3):
            pacer.observe(0.010 + 0.002, decoding=16, prefill_tokens=MIN_CHUNK)
        assert pacer.chunk(decoding=16, prompts=1) == expected
        assert PrefillPacer(1.5, 2048, ladder=ladder, step_tokens=None)._step_bound(1) == 2048
