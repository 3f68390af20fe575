"""Short prompts go ahead of a long prefill, on the real tiny model.

``runtime.short_prompts_first``: while a long prompt (more than ``SHORT_PROMPT``
tokens to prefill) is being prefilled, a short one that arrives is prefilled on
its own while the long prompt's batch waits aside, untouched, and comes back
once the short one decodes. The engine's greedy tokens are those of each
request run alone; the long prompt loses two steps to each short one and keeps
going under a stream of them; a short prompt still joins long ones about to
finish at about its depth (followers of a system prompt just stored), but not
ones far from it; an abort reaches a prompt set aside (its prefill
kept in the prompt cache like any other's); the generator's byte count sees
the batch set aside; with ``--short-prompts-join`` the short prompt joins the
long one's batch as mlx-lm has it. With a chunk's layers spread over steps
(``--prefill-chunk-parts``), a short prompt waits for the chunk in flight to be
whole before the long one steps aside, and every request keeps its tokens.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.engine.pacing import SHORT_PROMPT
from runtime.messages import Abort, SamplingParams, Submit
from runtime.short_prompts_first import ShortFirstGenerator

STEP = 64
LONG = SHORT_PROMPT + 400  # 1,424 tokens: 23 prefill steps of 64


def submit(request_id: int, prompt, *, max_tokens: int = 5) -> Submit:
    prompt = tuple(prompt)
    return Submit(request_id=request_id, prompt=prompt, segments=(prompt,),
                  segment_types=("user",), max_tokens=max_tokens, sampling=SamplingParams())


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 480) for _ in range(n)]


def new_core(model_path: str, **settings_):
    config = ServerConfig(model=model_path, prefill_step_size=STEP, admission_window_ms=0,
                          aborted_prefill_min_tokens=128, **settings_)
    return make_engine_core(config, model_path)


@pytest.fixture(scope="module")
def cores(tiny_model_path):
    return {"aside": new_core(tiny_model_path),
            "join": new_core(tiny_model_path, short_prompts_join=True),
            "parts": new_core(tiny_model_path, prefill_chunk_parts=2)}


class Trace:
    """Each step's prompt progress ({request: done}) and whether a batch was aside."""

    def __init__(self):
        self.steps: list[tuple[dict[int, int], bool]] = []
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}

    def step(self, core) -> None:
        out = core.step()
        self.steps.append(({p.request_id: p.done for p in out.progress},
                           getattr(core._batch, "stepped_aside", False)))
        for e in out.tokens:
            self.tokens.setdefault(e.request_id, []).append(e.token)
            if e.finish_reason is not None:
                self.ended[e.request_id] = str(e.finish_reason)
        for a in out.aborted:
            self.ended[a.request_id] = "aborted"
        for f in out.failed:
            self.ended[f.request_id] = f"failed: {f.message}"


def drive(core, arrivals: dict[int, list[Submit]], aborts: dict[int, list[int]] | None = None,
          steps: int = 400) -> Trace:
    """``arrivals[k]``: the requests submitted before step k; ``aborts[k]``: aborted then."""
    trace = Trace()
    aborts = aborts or {}
    for k in range(steps):
        for sub in arrivals.get(k, ()):
            core.handle_command(sub)
        for request_id in aborts.get(k, ()):
            core.handle_command(Abort(request_id=request_id))
        if k > max([*arrivals, *aborts]) and not core.has_work:
            return trace
        trace.step(core)
    raise AssertionError("the engine did not finish its requests")


def empty_cache(core) -> None:
    core.cache_entries.settle()
    core.cache_entries.evict(list(core.cache_entries.held()))


_alone: dict[tuple, list[int]] = {}


def alone(core, prompt, max_tokens: int = 5) -> list[int]:
    """The greedy tokens of ``prompt`` run by itself (the prompt cache emptied first)."""
    key = (tuple(prompt), max_tokens)
    if key not in _alone:
        empty_cache(core)
        trace = drive(core, {0: [submit(999_999, prompt, max_tokens=max_tokens)]})
        _alone[key] = trace.tokens[999_999]
    return _alone[key]


def test_a_short_prompt_is_prefilled_alone_while_the_long_one_waits_aside(cores):
    core = cores["aside"]
    long_prompt, short_prompt = tokens(LONG, 1), tokens(40, 2)
    expected = {1: alone(core, long_prompt), 2: alone(core, short_prompt)}
    empty_cache(core)
    trace = drive(core, {0: [submit(1, long_prompt)], 3: [submit(2, short_prompt)]})

    assert trace.tokens == expected
    progress = [p for p, _ in trace.steps]
    # Three chunks of the long prompt, then two steps of the short one alone: its
    # prompt but the last token, then that token (it leaves for decoding).
    assert progress[:5] == [{1: 64}, {1: 128}, {1: 192}, {2: 39}, {2: 40}]
    assert [aside for _, aside in trace.steps[:6]] == [False, False, False, True, True, False]
    # Then the long prompt goes on where it was, alone.
    assert progress[5] == {1: 256}
    assert all(set(p) <= {1} for p in progress[5:])
    assert core._short_first.stepped_aside >= 1


def test_the_pacer_learns_from_the_long_prompts_steps_only(cores, monkeypatch):
    """The steps with the long prompt's batch aside prefill another prompt at another
    depth: the pacer's line of a step's cost against its tokens leaves them out."""
    core = cores["aside"]
    empty_cache(core)
    timed: list[bool] = []
    after = core._paced.after
    monkeypatch.setattr(core._paced, "after", lambda seconds: (
        timed.append(core._batch.stepped_aside), after(seconds)))
    trace = drive(core, {0: [submit(1, tokens(LONG, 12))], 3: [submit(2, tokens(40, 13))]})
    assert [aside for _, aside in trace.steps[:6]] == [False, False, False, True, True, False]
    assert len(timed) == len(trace.steps) - 2 and not any(timed)


def test_with_short_prompts_join_it_joins_the_long_prompts_batch(cores):
    core = cores["join"]
    long_prompt, short_prompt = tokens(LONG, 1), tokens(40, 2)
    trace = drive(core, {0: [submit(1, long_prompt)], 3: [submit(2, short_prompt)]})
    assert trace.steps[3][0] == {1: 256, 2: 39}  # one lockstep batch
    assert not any(aside for _, aside in trace.steps)
    assert trace.tokens == {1: alone(cores["aside"], long_prompt),
                            2: alone(cores["aside"], short_prompt)}


def test_short_prompts_go_ahead_of_a_waiting_long_one_which_does_not_overtake(cores):
    """A second long prompt waits for the first; a short one that comes after it is
    prefilled first, and the second long prompt does not join the short one's batch
    or start before the first long one is done."""
    core = cores["aside"]
    empty_cache(core)
    first, second, short = tokens(LONG, 3), tokens(LONG, 4), tokens(30, 5)
    trace = drive(core, {0: [submit(1, first)], 2: [submit(2, second), submit(3, short)]})
    progress = [p for p, _ in trace.steps]
    assert progress[2] == {3: 29}
    assert 2 not in progress[3]
    assert progress[4] == {1: 192}
    first_done = next(k for k, p in enumerate(progress) if p.get(1) == len(first))
    assert all(2 not in p for p in progress[:first_done])
    assert trace.tokens[1] == alone(core, first)
    assert trace.tokens[2] == alone(core, second)
    assert trace.tokens[3] == alone(core, short)


def test_under_a_stream_of_short_prompts_the_long_one_keeps_going(cores):
    core = cores["aside"]
    empty_cache(core)
    long_prompt = tokens(2 * SHORT_PROMPT + 400, 6)  # the short ones would be padded far
    arrivals = {0: [submit(1, long_prompt, max_tokens=2)]}
    for k in range(2, 40):  # one short prompt before every step
        arrivals[k] = [submit(100 + k, tokens(20, 100 + k), max_tokens=2)]
    trace = drive(core, arrivals)
    progress = [p for p, _ in trace.steps]
    long_steps = [k for k, p in enumerate(progress[:40]) if 1 in p]
    # Never in lockstep: no step prefills the long prompt and a short one together.
    assert all(p == {1: p[1]} for p in progress if 1 in p)
    # Every short prompt got its own steps, and the long prompt at least one step in three.
    assert len(long_steps) >= 40 // 3
    assert all(b - a <= 3 for a, b in zip(long_steps, long_steps[1:], strict=False))
    assert trace.ended[1] == "length"
    assert all(trace.ended[100 + k] == "length" for k in range(2, 40))


def test_a_short_prompt_joins_a_long_one_about_to_finish_at_about_its_depth(cores):
    """Like followers of a system prompt their leader has just stored: the long prompt
    has at most ``SHORT_PROMPT`` tokens left and the short one would be padded by no
    more than that, so it joins, and the long one's first token is not held back."""
    core = cores["aside"]
    empty_cache(core)
    long_prompt, short_prompt = tokens(SHORT_PROMPT + 76, 14), tokens(40, 15)  # 1,099 to go
    trace = drive(core, {0: [submit(1, long_prompt)], 2: [submit(2, short_prompt)]})
    assert trace.steps[2][0] == {1: 192, 2: 39}  # 1,100 - 128 left, 128 deep: it joins
    assert not any(aside for _, aside in trace.steps)
    assert trace.tokens == {1: alone(core, long_prompt), 2: alone(core, short_prompt)}


def test_a_short_prompt_far_deeper_than_a_long_one_about_to_finish_goes_ahead(cores):
    """Joining pads the shallower rows to the deepest, either side: a short turn after a
    2,000-token cached history would pad a long prompt 128 tokens deep by 1,900."""
    core = cores["aside"]
    empty_cache(core)
    history = tokens(2000, 16)
    drive(core, {0: [submit(1, history, max_tokens=2)]})  # leaves its KV in the cache
    long_prompt, turn = tokens(SHORT_PROMPT + 76, 17), history + tokens(40, 18)
    trace = drive(core, {0: [submit(2, long_prompt)], 2: [submit(3, turn)]})
    assert trace.steps[2] == ({3: 39}, True)  # its 40 new tokens but the last, alone
    assert trace.tokens[2] == alone(core, long_prompt)
    assert trace.tokens[3] == alone(core, turn)


def test_an_abort_reaches_a_prompt_set_aside_and_keeps_its_prefill(cores):
    core = cores["aside"]
    long_prompt, short_prompt = tokens(LONG, 7), tokens(40, 8)
    expected = alone(core, short_prompt)
    empty_cache(core)
    kept = core.stats().aborted_prefills_kept
    trace = drive(core, {0: [submit(1, long_prompt)], 3: [submit(2, short_prompt)]},
                  aborts={4: [1]})  # while the short one is prefilled
    assert trace.ended == {1: "aborted", 2: "length"}
    assert trace.tokens[2] == expected
    assert core.stats().aborted_prefills_kept == kept + 1
    assert not core._batch.stepped_aside
    assert core._batch.prompt_cache_nbytes == 0
    # The same long prompt again resumes from the three chunks it had computed.
    started = {}
    core.handle_command(submit(3, long_prompt))
    while core.has_work:
        out = core.step()
        started.update({s.request_id: s.cached_tokens for s in out.started})
    assert started[3] == 3 * STEP


def test_an_abort_of_the_short_prompt_brings_the_long_one_back(cores):
    core = cores["aside"]
    empty_cache(core)
    long_prompt = tokens(LONG, 9)
    trace = drive(core, {0: [submit(1, long_prompt)], 3: [submit(2, tokens(40, 10))]},
                  aborts={4: [2]})
    assert trace.ended == {2: "aborted", 1: "length"}
    assert trace.steps[4][0] == {1: 256}  # back at the very next step
    assert trace.tokens[1] == alone(core, long_prompt)


def test_the_byte_count_sees_the_batch_set_aside(tiny_model_path):
    from mlx_lm import load

    from runtime.batch_sampling import BatchSampler, make_batch_generator

    model = load(tiny_model_path)[0]
    gen = make_batch_generator(model, sampler=BatchSampler(), prefill_step_size=STEP)
    assert isinstance(gen, ShortFirstGenerator)
    (uid,) = gen.insert([tokens(300, 11)], max_tokens=[2])
    gen.next()
    held = gen.prompt_cache_nbytes
    assert held > 0
    gen.step_aside()
    assert gen.stepped_aside and len(gen._prompt_batch) == 0
    assert gen.prompt_cache_nbytes == held
    cache, cached_tokens = gen.extract_cache([uid])[uid]
    assert len(cached_tokens) == STEP and cache[0].offset == STEP
    with pytest.raises(RuntimeError):
        gen.step_aside()
    gen.step_back()
    assert not gen.stepped_aside and gen._prompt_batch.uids == [uid]
    gen.step_aside()
    gen.remove([uid])
    assert not gen.stepped_aside and gen.prompt_cache_nbytes == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 12), st.sampled_from(["long", "short"]),
                                st.integers(0, 3)), min_size=1, max_size=5),
    aborts=st.lists(st.tuples(st.integers(0, 14), st.integers(0, 4)), max_size=2),
)
@pytest.mark.parametrize("kind", ["aside", "parts"])
def test_any_schedule_ends_every_request_once_with_its_own_tokens(cores, kind, arrivals, aborts):
    """Prompts of a small fixed set arrive at random steps, some aborted at random:
    each request ends once, a finished one with the tokens it has alone, and nothing
    is left aside or held afterwards (also with chunks spread over steps)."""
    core = cores[kind]
    empty_cache(core)
    prompts = {("long", i): tokens(LONG + 64 * i, 20 + i) for i in range(4)}
    prompts |= {("short", i): tokens(30 + 50 * i, 30 + i) for i in range(4)}
    by_step: dict[int, list[Submit]] = {}
    for n, (step, kind, which) in enumerate(arrivals):
        by_step.setdefault(step, []).append(submit(n + 1, prompts[kind, which], max_tokens=3))
    aborted: dict[int, list[int]] = {}
    for step, n in aborts:
        if n < len(arrivals) and arrivals[n][0] <= step:
            aborted.setdefault(step, []).append(n + 1)
    trace = drive(core, by_step, aborted)
    assert set(trace.ended) == set(range(1, len(arrivals) + 1))
    for n, (_, kind, which) in enumerate(arrivals):
        if trace.ended[n + 1] != "aborted":
            assert trace.ended[n + 1] == "length"
            core_tokens = trace.tokens[n + 1]
            assert core_tokens == alone(cores["aside"], prompts[kind, which], max_tokens=3)
    assert not core._batch.stepped_aside
    assert core._batch.prompt_cache_nbytes == 0



def test_a_chunk_spread_over_steps_is_whole_before_a_short_prompt_goes_ahead(cores):
    """Three streams decode while a long prompt is prefilled with its chunks spread over
    two steps each; a short prompt arrives: it steps ahead only once the chunk in
    flight is whole, and every request gets the tokens it has alone."""
    core = cores["parts"]
    empty_cache(core)
    streams = [submit(10 + i, tokens(30, 40 + i), max_tokens=60) for i in range(3)]
    long_prompt, short_prompt = tokens(LONG, 1), tokens(40, 2)
    carried = []
    real = core._batch.chunk_in_flight
    trace = Trace()
    arrivals = {0: streams, 3: [submit(1, long_prompt)], 9: [submit(2, short_prompt)]}
    for k in range(400):
        for sub in arrivals.get(k, ()):
            core.handle_command(sub)
        if k > 9 and not core.has_work:
            break
        carried.append(real())
        trace.step(core)
    aside = [a for _, a in trace.steps]
    assert any(carried), "no chunk was spread over steps"
    # The batch never steps aside in a step that carries a chunk's later layers.
    assert not any(c and a for c, a in zip(carried, aside, strict=True))
    assert any(aside)
    for sub in [*streams, submit(1, long_prompt), submit(2, short_prompt)]:
        assert trace.tokens[sub.request_id] == alone(cores["aside"], sub.prompt,
                                                     max_tokens=sub.max_tokens)
