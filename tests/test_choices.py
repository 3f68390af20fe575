"""Several choices of one request (n > 1): the engine computes the prompt once.

Over the fake batch generator (determinism, what entered the batch and
when) and over mlx-lm's real ``BatchGenerator`` on the tiny model (the
prompt's tokens pass through the model once; the copied KV cache gives each
choice exactly what a request of its own would get). Also the Scheduler's
share of slots and KV reservations per choice.
"""

from __future__ import annotations

import attrs
import pytest

from actors.scheduler import SchedulerCore
from runtime.engine.core import EngineCore
from runtime.messages import Abort, AbortReason, SamplingParams, StepOutputs
from tests.fakes import FakeKVCache, scripted_token
from tests.test_properties_scheduler import VOCAB, Ledger, engine_with_fake, make_submit

PROMPT = (1, 1, 1, 1, 2)


def group(first: int = 1, n: int = 3, *, split: bool = True, max_tokens: int = 6):
    """A Submit of ``n`` choices; ``split``: the fake reports its prompt up to the last
    token as a segment of its own (as mlx-lm's BatchGenerator always does)."""
    segments = (PROMPT[:-1], PROMPT[-1:]) if split else (PROMPT,)
    submit = make_submit(first, PROMPT, max_tokens=max_tokens, segments=segments,
                         types=("user",) * len(segments))
    return attrs.evolve(submit, choice_ids=tuple(range(first + 1, first + n)))


def run(core: EngineCore, ledger: Ledger, steps: int = 40) -> list[StepOutputs]:
    outs = []
    for _ in range(steps):
        out = core.step()
        ledger.record(out)
        outs.append(out)
        if not core.has_work:
            break
    return outs


def tokens_of(outs: list[StepOutputs], request_id: int) -> list[int]:
    return [e.token for out in outs for e in out.tokens if e.request_id == request_id]


def test_the_other_choices_start_from_the_first_ones_cache():
    core, factory, _ = engine_with_fake(per_segment=True, batch=8)
    ledger = Ledger()
    core.handle_command(group(1, 3))
    assert core.active_request_ids == {1, 2, 3}
    gen = factory.current
    assert len(gen.inserted) == 1  # the first alone, until its prompt...
    outs = run(core, ledger)
    started = {s.request_id: s for out in outs for s in out.started}
    # ... is processed up to its last token: then the others, from a copy of that cache.
    names = [name for name, _ in gen.calls]
    assert names[:4] == ["insert_segments", "next", "extract_cache", "insert_segments"]
    assert started[2].cached_tokens == started[3].cached_tokens == len(PROMPT) - 1
    for uid in gen.inserted[1:]:
        seq = gen.sequences[uid]
        assert seq.cached == len(PROMPT) - 1 and seq.segments == [[PROMPT[-1]]]
    assert gen.extracted == [(gen.inserted[0],)]
    expected = [scripted_token(PROMPT, i, VOCAB) for i in range(6)]
    assert tokens_of(outs, 1) == tokens_of(outs, 2) == tokens_of(outs, 3) == expected
    assert set(ledger.terminal) == {1, 2, 3}
    assert len(gen.inserted) == 3
    # The prompt's tokens were given to the generator once, plus each other choice's last.
    assert outs[-1].stats.prompt_tokens_computed == len(PROMPT) + 2
    assert outs[-1].stats.prompt_cache_hits == 0  # copies are not prompt-cache hits


def test_without_a_point_to_share_from_the_choices_start_the_ordinary_way():
    core, factory, _ = engine_with_fake(per_segment=False, batch=8)
    ledger = Ledger()
    core.handle_command(group(1, 3, split=False))
    outs = run(core, ledger)
    gen = factory.current
    assert len(gen.inserted) == 3
    assert all(gen.sequences[uid].cached == 0 for uid in gen.inserted)
    assert tokens_of(outs, 1) == tokens_of(outs, 2) == tokens_of(outs, 3)
    assert set(ledger.terminal) == {1, 2, 3}


def test_aborting_the_first_choice_takes_the_waiting_ones_with_it():
    core, factory, _ = engine_with_fake(per_segment=True, batch=8)
    ledger = Ledger()
    core.handle_command(group(1, 3, split=True))
    core.handle_command(group(10, 2, split=True))
    core.handle_command(Abort(request_id=1))  # before its prompt was processed
    core.handle_command(Abort(request_id=11))  # a waiting choice alone
    outs = run(core, ledger)
    assert {r: ledger.terminal[r][0] for r in (1, 2, 3, 11)} == dict.fromkeys((1, 2, 3, 11),
                                                                              "aborted")
    assert ledger.terminal[10][0] == "finish"
    assert len(factory.current.inserted) == 2  # choices 2, 3 and 11 never entered
    assert tokens_of(outs, 10)


def test_a_failing_first_choice_fails_the_waiting_ones():
    core, factory, _ = engine_with_fake(per_segment=True, batch=8, fail_on_step=1)
    ledger = Ledger()
    core.handle_command(group(1, 3))
    run(core, ledger, steps=2)
    assert {r: ledger.terminal[r][0] for r in (1, 2, 3)} == dict.fromkeys((1, 2, 3), "failed")
    assert not core.has_work


def test_held_choices_are_aborted_one_by_one_or_together():
    core, _, _ = engine_with_fake(per_segment=True, batch=8)
    core.admission.window, core.admission.batch = 3600.0, 1
    core.handle_command(make_submit(99, (3, 3), max_tokens=30))
    core.step()
    core.handle_command(group(1, 3))  # held by the admission window
    core.handle_command(Abort(request_id=3))
    assert core.active_request_ids == {99, 1, 2}
    core.handle_command(Abort(request_id=1))
    assert core.active_request_ids == {99}
    assert {a.request_id for a in core.step().aborted} == {1, 2, 3}


def test_the_scheduler_gives_each_choice_a_slot_and_a_share_of_the_reservation():
    core = SchedulerCore(max_in_engine=4, max_waiting=4, kv_budget=10_000)
    a = attrs.evolve(make_submit(1), choice_ids=(2, 3), kv_bytes=3000)
    b = attrs.evolve(make_submit(4), choice_ids=(5,), kv_bytes=2000)
    core.admit(a)
    core.admit(b)
    assert core.to_start() == [a]  # b needs 2 slots, 1 is free
    assert core.in_engine == {1, 2, 3} and core.kv_reserved == 3000
    core.on_outputs(StepOutputs(aborted=(), tokens=()))
    from runtime.messages import SequenceAborted

    core.on_outputs(StepOutputs(aborted=(SequenceAborted(request_id=2),)))
    assert core.kv_reserved == 2000
    assert core.to_start() == [b]
    assert core.in_engine == {1, 3, 4, 5}
    big = attrs.evolve(make_submit(6), choice_ids=tuple(range(7, 12)), kv_bytes=100)
    core.admit(big)
    assert core.to_start() == []  # 6 choices: more than the slots, so it waits for an empty engine
    for request_id in (1, 3, 4, 5):
        core.abort(request_id, AbortReason.CLOSED)
    assert core.to_start() == [big] and len(core.in_engine) == 6


# ------------------------------------------------- mlx-lm's BatchGenerator, tiny model


class CountingModel:
    """The model, counting the prompt tokens of each prefill call ([batch, length > 1])."""

    def __init__(self, model):
        self._model = model
        self.prefill_tokens = 0

    def __call__(self, inputs, *args, **kwargs):
        if inputs.shape[1] > 1:
            self.prefill_tokens += inputs.shape[0] * inputs.shape[1]
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def tiny_handle(tiny_model_path):
    from runtime.config import ServerConfig
    from runtime.engine.loading import load_model

    return load_model(ServerConfig(model=tiny_model_path), tiny_model_path)


def real_engine(handle) -> tuple[EngineCore, CountingModel]:
    from mlx_lm.generate import BatchGenerator

    from runtime.sampling import build_sampler
    from tests.fakes import FakePromptCache

    counting = CountingModel(handle.model)
    core = EngineCore(
        attrs.evolve(handle, model=counting),
        batch_generator_factory=lambda: BatchGenerator(counting, prefill_step_size=64),
        prompt_cache=FakePromptCache(),
        sampler_factory=lambda params: build_sampler(params, []),
    )
    return core, counting


def generate(core: EngineCore, submit) -> dict[int, list[int]]:
    ledger = Ledger()
    core.handle_command(submit)
    outs = run(core, ledger, steps=200)
    assert set(ledger.terminal) == set(submit.request_ids)
    return {r: tokens_of(outs, r) for r in submit.request_ids}


@pytest.mark.parametrize("seed", [None, 42])
def test_the_prompt_passes_through_the_model_once(tiny_handle, seed):
    never_end = tuple((e, -100.0) for e in tiny_handle.tokenizer.eos_token_ids)
    sampling = SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed,
                              logit_bias=never_end)
    prompt = tuple(20 + (i * 3) % 400 for i in range(150))  # 3 prefill chunks of 64
    first = attrs.evolve(make_submit(1, prompt, max_tokens=8, segments=(prompt,)),
                         sampling=sampling)
    core, counting = real_engine(tiny_handle)
    together = generate(core, attrs.evolve(first, choice_ids=(2, 3, 4)))
    assert counting.prefill_tokens == len(prompt) - 1  # not 4 x that
    # Each choice is what a request of its own (with seed + index) would have been.
    for index, request_id in enumerate((1, 2, 3, 4)):
        alone_sampling = sampling if seed is None else attrs.evolve(sampling, seed=seed + index)
        alone_core, _ = real_engine(tiny_handle)
        alone = generate(alone_core, attrs.evolve(first, request_id=50 + index,
                                                  sampling=alone_sampling))
        assert together[request_id] == alone[50 + index]
    if seed is not None:
        assert len({tuple(t) for t in together.values()}) > 1


def test_fake_kv_cache_copies_are_independent():
    cache = [FakeKVCache((1, 2, 3))]
    from runtime.engine.choices import starts

    copies = starts(cache, 3, own=True)
    assert copies[-1] is cache and copies[0] is not cache and copies[0] == cache
    assert all(c is not cache and c == cache for c in starts(cache, 2))
    assert starts(None, 2) == [None, None]
