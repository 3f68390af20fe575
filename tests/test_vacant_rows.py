"""Vacant rows (runtime.vacant_rows): a leaving row's place kept for a joining one.

Against the real generator on the tiny model (CPU): the same greedy tokens for every
sequence with and without vacant rows, while rows leave, join into vacant places,
are removed, and vacant rows expire, in fixed schedules and in any schedule
(hypothesis); no whole-batch copy where a row fills a place; a vacant row never
finishes; and the engine as ``make_engine_core`` wires it answers every kind of
request as it does without them.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from runtime.batch_sampling import BatchSampler, make_batch_generator
from runtime.compiled_decode import install_compiled_decode
from runtime.tiny_model import build_tiny_model
from runtime.vacant_rows import RowReuse, install_row_reuse


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("vacant") / "qwen3"))


def generator(model_path: str, *, reuse_steps: int, chunk_pass: str = "shared",
              lane_padding: int = 0):
    model, _ = load(model_path)
    install_compiled_decode(model)
    gen = make_batch_generator(
        model, sampler=BatchSampler(), chunk_pass=chunk_pass, lane_padding=lane_padding,
        completion_batch_size=8, prefill_batch_size=8, prefill_step_size=64,
    )
    # min_bytes 0: the tiny model's batch is far below any real device's share.
    install_row_reuse(gen, reuse_steps, min_bytes=0)
    return gen


def prompt(seed: int, length: int) -> list[int]:
    return [10 + (seed * 31 + i * 7) % 250 for i in range(length)]


# Four sessions decode; as turns end, new turns (no longer than what the batch holds)
# arrive a few steps later, as agents' next requests do.
FIRST = [(prompt(s, 90 + 9 * s), m) for s, m in enumerate([24, 40, 56, 120])]
LATER = {30: [(prompt(7, 60), 30)], 34: [(prompt(8, 80), 25), (prompt(9, 40), 20)],
         52: [(prompt(10, 100), 40)], 70: [(prompt(11, 30), 12)]}


def run(gen, *, remove_at: dict[int, int] | None = None, watch=None):
    """``scheduled_run`` of FIRST at step 0 and LATER."""
    return scheduled_run(gen, {0: FIRST, **LATER}, remove_at or {}, watch=watch)


def scheduled_run(gen, arrivals: dict, removals: dict, *, watch=None) -> list[list[int]]:
    """Every sequence's tokens, in the order inserted. ``arrivals``: step -> prompts with
    their max_tokens; ``removals``: step -> the index (in insertion order) of a
    sequence removed at that step, if it still runs; ``watch(gen)`` after each step."""
    uids: list[int] = []
    out: dict[int, list[int]] = {}
    left: set[int] = set()
    for step in range(1000):
        if step in arrivals:
            new = gen.insert([p for p, _ in arrivals[step]],
                             max_tokens=[m for _, m in arrivals[step]])
            uids += new
            out.update({u: [] for u in new})
            left.update(new)
        if step in removals and removals[step] < len(uids) and uids[removals[step]] in left:
            gen.remove([uids[removals[step]]])
            left.discard(uids[removals[step]])
        for r in gen.next()[1]:
            assert r.uid >= 0  # a vacant row never answers
            if r.uid in left:
                out[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
        if watch is not None:
            watch(gen)
        if not left and step >= max(arrivals):
            return [out[u] for u in uids]
    raise AssertionError("the sequences did not finish")


@pytest.mark.parametrize("chunk_pass", ["shared", "separate"])
def test_vacant_rows_give_the_tokens_of_mlx_lms_filter_and_extend(model_path, chunk_pass):
    plain = run(generator(model_path, reuse_steps=0, chunk_pass=chunk_pass))
    gen = generator(model_path, reuse_steps=64, chunk_pass=chunk_pass)
    reuse = gen._generation_batch.row_reuse
    assert isinstance(reuse, RowReuse)
    assert run(gen) == plain
    assert reuse.vacated >= 4 and reuse.filled >= 2  # rows left, and joiners took places
    assert len(gen._generation_batch) == 0


def test_a_joining_row_fills_a_place_without_copying_the_batch(model_path, monkeypatch):
    """A join that fills a vacant place calls no layer's ``BatchKVCache.extend`` (mlx-lm's
    padding and concatenation of the whole batch); one that finds none extends every
    layer, as before."""
    import runtime.mlx_lm_batches as batches
    import runtime.vacant_rows as vacant_rows

    gen = generator(model_path, reuse_steps=64)
    joins: list[tuple[bool, int, int]] = []  # (filled, rows before, layer extends)
    layer_extends = []
    real_fill, real_layer_extend = vacant_rows.fill, BatchKVCache.extend
    real_join = batches.RowAwareGenerationBatch.extend
    filled = []

    def spy_fill(*args):
        filled.append(real_fill(*args))
        return filled[-1]

    def spy_layer_extend(self, other):
        layer_extends.append(self)
        return real_layer_extend(self, other)

    def spy_join(self, batch):
        rows, before = len(self.uids), len(layer_extends)
        real_join(self, batch)
        joins.append((filled[-1], rows, len(layer_extends) - before))

    monkeypatch.setattr(vacant_rows, "fill", spy_fill)
    monkeypatch.setattr(BatchKVCache, "extend", spy_layer_extend)
    monkeypatch.setattr(batches.RowAwareGenerationBatch, "extend", spy_join)
    run(gen)
    layers = len(load(model_path)[0].layers)
    assert any(f for f, _, _ in joins) and any(not f and rows for f, rows, _ in joins)
    for was_filled, rows, extends in joins:
        assert extends == (0 if was_filled or not rows else layers)


def test_a_removed_row_is_vacated_and_the_others_decode_as_before(model_path):
    plain = run(generator(model_path, reuse_steps=0), remove_at={12: 3})
    gen = generator(model_path, reuse_steps=64)
    vacated = []
    got = run(gen, remove_at={12: 3},
              watch=lambda g: vacated.append(g._generation_batch.row_reuse.vacated))
    assert got == plain
    assert vacated[12] >= 1  # the removal vacated the row at that step


def test_vacant_rows_expire_after_their_steps(model_path):
    gen = generator(model_path, reuse_steps=3)
    batch = gen._generation_batch
    seen: list[tuple[int, int]] = []  # (rows, vacant rows) after each step
    plain = run(generator(model_path, reuse_steps=0))
    assert run(gen, watch=lambda g: seen.append((len(batch), len(batch.row_reuse.vacant)))) == plain
    # a row vacated at one step is gone within the next three
    for step, (_, vacant) in enumerate(seen):
        if vacant and step + 4 < len(seen):
            assert any(v == 0 or r < seen[step][0] for r, v in seen[step + 1:step + 5])
    assert max(v for _, v in seen) >= 1


def test_without_reuse_a_batch_filters_and_extends_as_mlx_lm(model_path):
    gen = generator(model_path, reuse_steps=0)
    assert gen._generation_batch.row_reuse is None
    assert not install_row_reuse(gen, 0, 0)


def test_decode_lanes_give_their_new_lanes_the_setting(model_path):
    plain = run(generator(model_path, reuse_steps=0, lane_padding=40))
    gen = generator(model_path, reuse_steps=64, lane_padding=40)
    lanes = gen._generation_batch
    opened = []
    got = run(gen, watch=lambda g: opened.extend(
        lane.row_reuse for lane in lanes.lanes[1:] if lane.row_reuse is not None))
    assert got == plain
    assert lanes.opened >= 1 and opened


# ----------------------------------------------------------------- the engine

def user_submit(tokenizer, request_id: int, text: str, max_tokens: int, **fields):
    """A Submit of one user message ``text``, greedy unless ``fields`` say otherwise."""
    from runtime.messages import SamplingParams, Submit

    prompt = tuple(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, enable_thinking=False))
    fields.setdefault("sampling", SamplingParams())
    return Submit(request_id=request_id, prompt=prompt, segments=(prompt,),
                  segment_types=("user",), max_tokens=max_tokens, **fields)


def engine_run(core, waves: dict[int, list], abort_at: dict[int, int]) -> dict:
    """Submit ``waves`` (step -> Submits) and ``abort_at`` (step -> request id); each
    request's tokens, finish reason and failure."""
    from runtime.messages import Abort

    seen: dict[int, dict] = {}
    for step in range(600):
        for s in waves.get(step, []):
            seen[s.request_id] = {"tokens": [], "reason": None, "failed": None}
            core.handle_command(s)
        if step in abort_at:
            core.handle_command(Abort(request_id=abort_at[step]))
        out = core.step()
        for e in out.tokens:
            seen[e.request_id]["tokens"].append(e.token)
            if e.finish_reason is not None:
                seen[e.request_id]["reason"] = str(e.finish_reason)
        for e in out.failed:
            seen[e.request_id]["failed"] = e.message
        if step > max(waves) and not core.has_work:
            return seen
    raise AssertionError("the engine did not finish its requests")


def test_the_engine_answers_the_same_with_vacant_rows(tiny_model_path, monkeypatch):
    """The engine as ``make_engine_core`` wires it, its batches counted large: greedy,
    seeded, penalised (a logits processor) and schema-constrained requests that leave
    and join at different steps, one aborted, answer as they do without vacant rows;
    every sampler registration is gone at the end."""
    import jsonschema

    import runtime.engine.loading as loading
    from runtime.config import ServerConfig
    from runtime.grammar import compile_constraint
    from runtime.messages import SamplingParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def waves(core):
        tok = core.handle.tokenizer

        def submit(i, text, max_tokens, **fields):
            return user_submit(tok, i, text, max_tokens, **fields)

        constraint = compile_constraint(tok, response_format={
            "type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
            allow_thinking=False)
        return {
            0: [submit(0, "one " * 30, 12), submit(1, "two " * 40, 40),
                submit(2, "three " * 35, 60, sampling=SamplingParams(temperature=0.9, seed=3)),
                submit(3, "four " * 20, 80, sampling=SamplingParams(repetition_penalty=1.3))],
            20: [submit(4, "five", 20), submit(5, "json please", 40, constraint=constraint)],
            30: [submit(6, "six " * 10, 25)],
            45: [submit(7, "seven", 15, sampling=SamplingParams(temperature=0.8, seed=9))],
        }

    results = {}
    for steps in (0, 64):
        config = ServerConfig(model=tiny_model_path, decode_row_reuse_steps=steps)
        monkeypatch.setattr(loading, "large_batch_bytes", lambda mx: 0)
        core = loading.make_engine_core(config, tiny_model_path)
        results[steps] = engine_run(core, waves(core), abort_at={35: 1})
        batch = core._batch._generation_batch
        first = batch.lanes[0] if hasattr(batch, "lanes") else batch
        reuse = first.row_reuse
        if steps:
            assert reuse is not None and reuse.vacated >= 3 and reuse.filled >= 1
        else:
            assert reuse is None
        assert core.batch_sampler.registered == 0
    assert results[64] == results[0]
    got = results[64]
    assert all(got[i]["failed"] is None for i in got)
    assert got[1]["reason"] is None and 0 < len(got[1]["tokens"]) < 40  # aborted on the way
    if got[5]["reason"] == "stop":  # the constrained reply, where it ended by itself
        eos = set(core.handle.tokenizer.eos_token_ids)
        jsonschema.validate(json.loads(core.handle.tokenizer.decode(
            [t for t in got[5]["tokens"] if t not in eos])), schema)


def test_a_vacant_row_never_finishes(model_path):
    """A vacant row runs without a limit or stop sequences of its own: it ends only by
    being taken or by expiring, never as a sequence that finished (whose cache the
    batch would extract)."""
    gen = generator(model_path, reuse_steps=500)
    uids = gen.insert([prompt(1, 40), prompt(2, 50), prompt(3, 60)], max_tokens=[4, 120, 120])
    batch = gen._generation_batch
    extracted = []
    real_extract = batch.extract_cache
    batch.extract_cache = lambda idx: (extracted.append(batch.uids[idx]), real_extract(idx))[1]
    finished = []
    for _ in range(400):
        finished += [r.uid for r in gen.next()[1] if r.finish_reason is not None]
        if len(finished) == 3:
            break
    assert sorted(finished) == sorted(uids) and sorted(extracted) == sorted(uids)
    assert batch.row_reuse.vacated >= 1


@st.composite
def schedules(draw):
    """Arrivals (step -> prompts with their max_tokens) and removals (step -> the index,
    in insertion order, of a sequence to remove if it still runs)."""
    arrivals = {0: [(prompt(draw(st.integers(0, 50)), draw(st.integers(20, 120))),
                     draw(st.integers(2, 60))) for _ in range(draw(st.integers(2, 6)))]}
    for _ in range(draw(st.integers(0, 5))):
        step = draw(st.integers(1, 80))
        arrivals.setdefault(step, []).extend(
            (prompt(draw(st.integers(0, 50)), draw(st.integers(5, 150))), draw(st.integers(1, 50)))
            for _ in range(draw(st.integers(1, 3))))
    removals = {draw(st.integers(1, 90)): draw(st.integers(0, 20))
                for _ in range(draw(st.integers(0, 2)))}
    return arrivals, removals


@settings(max_examples=12, deadline=None)
@given(schedule=schedules(), reuse_steps=st.sampled_from([1, 4, 64]),
       lane_padding=st.sampled_from([0, 60]))
def test_any_schedule_gives_the_tokens_of_mlx_lms_filter_and_extend(
        model_path, schedule, reuse_steps, lane_padding):
    arrivals, removals = schedule
    plain = scheduled_run(generator(model_path, reuse_steps=0, lane_padding=lane_padding),
                          arrivals, removals)
    with_vacant = scheduled_run(
        generator(model_path, reuse_steps=reuse_steps, lane_padding=lane_padding),
        arrivals, removals)
    assert with_vacant == plain


def test_vacant_rows_hold_no_prompt_back(model_path):
    """The generator's ``completion_batch_size`` does not count vacant rows: prompts
    that arrive while rows are vacant start decoding in the step they would without
    them (here the batch's limit of 8 rows would otherwise hold two of four back)."""
    from runtime.vacant_rows import vacant_count

    decoding = {}
    for steps in (0, 500):
        gen = generator(model_path, reuse_steps=steps)
        gen.insert([prompt(s, 30) for s in range(6)], max_tokens=[3, 3, 3, 100, 100, 100])
        batch = gen._generation_batch
        for _ in range(6):
            gen.next()
        if steps:
            assert vacant_count(batch) == 3 and len(batch) == 6
            assert gen.completion_batch_size == 8 + 3
        gen.insert([prompt(s, 10) for s in range(10, 14)], max_tokens=[50] * 4)
        decoding[steps] = []
        for _ in range(6):
            gen.next()
            decoding[steps].append(len([u for u in batch.uids if u >= 0]))
    assert decoding[500] == decoding[0] and decoding[0][-1] == 7


def test_a_longer_row_joining_leaves_room_for_the_next_longer_one(model_path, monkeypatch):
    """A row longer than the batch's keys joins by mlx-lm's copy, which leaves every row
    ``JOIN_MARGIN`` positions of room: the next row, longer again but within that room,
    takes a vacant place instead of a second copy; the tokens are mlx-lm's either way."""
    import runtime.vacant_rows as vacant_rows

    arrivals = {0: [(prompt(s, 30), m) for s, m in enumerate([3, 3, 90, 90])],
                8: [(prompt(20, 120), 40)], 14: [(prompt(21, 200), 30)]}
    plain = scheduled_run(generator(model_path, reuse_steps=0), arrivals, {})
    fills = {}
    for margin in (0, vacant_rows.JOIN_MARGIN):
        monkeypatch.setattr(vacant_rows, "JOIN_MARGIN", margin)
        gen = generator(model_path, reuse_steps=64)
        assert scheduled_run(gen, arrivals, {}) == plain
        fills[margin] = gen._generation_batch.row_reuse.filled
    assert fills[0] == 0  # each longer row copied the batch
    assert fills[vacant_rows.JOIN_MARGIN] == 1  # the second took the place the first left


def test_a_leave_past_twice_the_room_in_shared_padding_filters_and_trims(model_path, monkeypatch):
    """Where the rows that stay share more than twice the room's padding (the longest
    rows gone), a leave filters the batch as mlx-lm does, which trims that padding,
    instead of leaving a vacant row; the tokens are mlx-lm's either way."""
    import runtime.vacant_rows as vacant_rows

    # short rows decode; two long ones join (and leave the room), finish first, and
    # leave the short rows sharing the padding they had beside the long ones
    arrivals = {0: [(prompt(s, 30), 30 + 5 * s) for s in range(4)],
                2: [(prompt(8, 120), 3), (prompt(9, 120), 3)]}
    plain = scheduled_run(generator(model_path, reuse_steps=0), arrivals, {})
    shared: dict[int, list[int]] = {}
    for margin in (8, 1024):
        monkeypatch.setattr(vacant_rows, "JOIN_MARGIN", margin)
        gen = generator(model_path, reuse_steps=64)
        shared[margin] = []

        def watch(g, margin=margin):
            b = g._generation_batch
            vacant = b.row_reuse.vacant
            pads = b.prompt_cache[0].left_padding.tolist() if len(b.prompt_cache) else []
            real = [p for i, p in enumerate(pads) if i not in vacant]
            shared[margin].append(min(real) if real else 0)

        assert scheduled_run(gen, arrivals, {}, watch=watch) == plain
    # beside the long rows the short ones had 90 positions of padding and the room;
    # once the long rows left: trimmed at once past 2 x 8, kept (vacant rows) under 2 x 1024
    assert max(shared[8]) <= 16 < min(s for s in shared[1024][5:20] if s)
