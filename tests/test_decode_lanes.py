"""Decode lanes (runtime.decode_lanes): sequences of very different lengths decode in
batches of their own, and give the very tokens of one batch.

The rule alone (``choose_lane``), the lanes' bookkeeping on fake batches under any
sequence of joins, steps, removals and extractions (hypothesis), and the real thing:
mlx (CPU) on a tiny model through the engine's own generator, short sequences
decoding while long prompts arrive, with and without a step's chunk sharing the
first lane's pass.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from runtime.batch_sampling import BatchSampler, make_batch_generator
from runtime.compiled_decode import install_compiled_decode
from runtime.decode_lanes import (
    MAX_LANES,
    DecodeLanes,
    added_padding,
    choose_lane,
    install_decode_lanes,
)
from runtime.tiny_model import build_tiny_model

# ----------------------------------------------------------------- the rule


def test_a_sequence_joins_the_lane_it_pads_least():
    lanes = [(16, 300), (1, 8000)]
    assert choose_lane(lanes, 1, 310, padding_limit=1000) == 0  # 16 x 10 positions
    assert choose_lane(lanes, 1, 7990, padding_limit=1000) == 1  # 10 positions
    assert added_padding(16, 300, 1, 310) == 160


def test_padding_past_the_limit_opens_a_lane_while_fewer_than_the_most_are_open():
    assert choose_lane([(16, 300)], 1, 8000, padding_limit=8192) is None  # 16 x 7,700
    assert choose_lane([(16, 300)], 1, 800, padding_limit=8192) == 0  # 16 x 500
    full = [(2, 100 + 10_000 * i) for i in range(MAX_LANES)]
    assert choose_lane(full, 1, 5_000_000, padding_limit=10) == MAX_LANES - 1
    assert choose_lane([(16, 300)], 1, 8000, padding_limit=0) == 0  # lanes off
    assert choose_lane([], 3, 50, padding_limit=10) is None


@given(
    lanes=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 40_000)), max_size=6),
    rows=st.integers(1, 8),
    length=st.integers(1, 40_000),
    limit=st.integers(0, 100_000),
)
def test_the_rule_never_pads_past_the_limit_where_it_could_open_a_lane(lanes, rows, length, limit):
    chosen = choose_lane(lanes, rows, length, padding_limit=limit)
    costs = [added_padding(r, n, rows, length) for r, n in lanes]
    if not lanes:
        assert chosen is None  # the first rows open the first lane
    elif chosen is None:
        assert limit > 0 and len(lanes) < MAX_LANES and min(costs) > limit
    else:
        assert costs[chosen] == min(costs)
        assert limit == 0 or costs[chosen] <= limit or len(lanes) >= MAX_LANES


# ------------------------------------------------- the bookkeeping, on fakes


class FakeBatch:
    """A generation batch's interface as ``DecodeLanes`` uses it: rows of a length,
    one token a step, finishing after their own number of steps."""

    def __init__(self, uids=(), lengths=(), left=()):
        self.uids, self.lengths, self.left = list(uids), list(lengths), list(left)
        self.model = self.fallback_sampler = None
        self.steps = 0

    @classmethod
    def empty(cls, model, fallback_sampler):
        return cls()

    @property
    def tokens(self):
        return [[uid] * n for uid, n in zip(self.uids, self.lengths, strict=True)]

    @property
    def prompt_cache(self):
        if not self.uids:
            return []
        layer = BatchKVCache([0] * len(self.uids))
        layer._idx = max(self.lengths)
        return [layer]

    def __len__(self):
        return len(self.uids)

    def extend(self, other):
        self.uids += other.uids
        self.lengths += other.lengths
        self.left += other.left

    def next(self):
        self.steps += 1
        self.lengths = [n + 1 for n in self.lengths]
        self.left = [n - 1 for n in self.left]
        out = list(zip(self.uids, [n <= 0 for n in self.left], strict=True))
        self.filter([i for i, n in enumerate(self.left) if n > 0])
        return out

    def filter(self, keep):
        self.uids = [self.uids[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self.left = [self.left[i] for i in keep]

    def extract_cache(self, idx):
        return ("cache of", self.uids[idx])


events = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(1, 3), st.integers(1, 5000), st.integers(1, 6)),
        st.tuples(st.just("step")),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("extract"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(events=events, limit=st.sampled_from([0, 64, 1000, 20_000]))
def test_lanes_keep_every_row_once_in_order_and_step_each_once(events, limit):
    lanes = DecodeLanes(FakeBatch(), padding_limit=limit)
    live: dict[int, int] = {}  # uid -> steps left
    next_uid = 0
    for event in events:
        if event[0] == "join":
            _, rows, length, steps = event
            uids = list(range(next_uid, next_uid + rows))
            next_uid += rows
            lanes.extend(FakeBatch(uids, [length] * rows, [steps] * rows))
            live.update(dict.fromkeys(uids, steps))
        elif event[0] == "step":
            out = lanes.next()
            assert sorted(uid for uid, _ in out) == sorted(live)  # every row, once
            for uid, finished in out:
                live[uid] -= 1
                assert finished == (live[uid] == 0)
                if finished:
                    del live[uid]
        elif live:
            idx = event[1] % len(lanes)
            uid = lanes.uids[idx]
            if event[0] == "remove":
                lanes.filter([i for i in range(len(lanes)) if i != idx])
                del live[uid]
            else:
                assert lanes.extract_cache(idx) == ("cache of", uid)
                assert lanes.tokens[idx][0] == uid
        assert sorted(lanes.uids) == sorted(live) and len(lanes) == len(live)
        assert 1 <= len(lanes.lanes) <= MAX_LANES
        assert all(len(lane) for lane in lanes.lanes[1:])  # only the first may be empty
        if limit == 0:
            assert len(lanes.lanes) == 1


# ------------------------------------------------------- the real generator

SHORT = [[5, 9, 12, 40], [3, 3, 8, 9, 10], [17, 2, 99], [4, 4, 4, 4, 6]]
LONG = [10 + (i * 7) % 300 for i in range(700)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("lanes") / "qwen3"))


def generator(model_path: str, *, lane_padding: int, chunk_pass: str = "shared"):
    model, _ = load(model_path)
    install_compiled_decode(model)
    return make_batch_generator(
        model, sampler=BatchSampler(), chunk_pass=chunk_pass, lane_padding=lane_padding,
        completion_batch_size=8, prefill_batch_size=8, prefill_step_size=64,
    )


def run(gen, *, remove_long_at: int | None = None, on_step=None):
    """Short sequences decode; a long prompt arrives, then a short and a second long one,
    and, once the short ones are done and the first long one decodes alone, a third
    prompt is prefilled beside it. Every sequence's tokens, and (``remove_long_at``) the
    first long one removed that many steps after its arrival, with its extracted cache
    and tokens; ``on_step(step)`` after each step."""
    out: dict[int, list[int]] = {}
    uids = gen.insert(SHORT[:2], max_tokens=[70, 60])
    out.update({u: [] for u in uids})
    arrivals = {3: ([LONG], [120]), 12: ([SHORT[2]], [25]), 20: ([LONG[:500]], [20]),
                26: ([SHORT[3]], [15]), 90: ([LONG[:300]], [10])}
    left, steps, removed, long_uid = set(uids), 0, None, None
    while left or arrivals:
        if steps in arrivals:
            new = gen.insert(*arrivals.pop(steps))
            long_uid = new[0] if long_uid is None and steps == 3 else long_uid
            uids += new
            out.update({u: [] for u in new})
            left.update(new)
        if remove_long_at is not None and steps == 3 + remove_long_at:
            removed = gen.remove([long_uid], return_prompt_caches=True).get(long_uid)
            left.discard(long_uid)
        for r in gen.next()[1]:
            if r.uid in left:
                out[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
        if on_step is not None:
            on_step(steps)
        steps += 1
    return [out[u] for u in uids], removed


@pytest.mark.parametrize("chunk_pass", ["shared", "separate"])
def test_lanes_give_the_tokens_of_one_batch(model_path, chunk_pass):
    one, _ = run(generator(model_path, lane_padding=0, chunk_pass=chunk_pass))
    gen = generator(model_path, lane_padding=256, chunk_pass=chunk_pass)
    lanes = gen._generation_batch
    assert isinstance(lanes, DecodeLanes)
    firsts: list[tuple[int, ...]] = []  # the first lane's rows, step by step
    passes: dict[int, int] = {}

    def watch(step):
        firsts.append(tuple(lanes.lanes[0].uids))
        passes[step] = getattr(lanes.model, "mixed_passes", 0)

    laned, _ = run(gen, on_step=watch)
    assert laned == one
    assert lanes.opened >= 1  # the long prompts decoded apart from the short rows
    assert len(lanes) == 0 and len(lanes.lanes) == 1
    # The short rows finished first and the first long one's lane became the first lane.
    assert (0, 1) in {f[:2] for f in firsts} and (2,) in firsts
    if chunk_pass == "shared":
        # The third prompt's chunks shared their passes with the lane that moved up.
        assert passes[max(passes)] > passes[89] > 0


def test_a_long_row_decodes_in_its_own_lane_and_its_removal_extracts_its_cache(model_path):
    _, whole = run(generator(model_path, lane_padding=0), remove_long_at=40)
    gen = generator(model_path, lane_padding=256)
    seen: list[list[int]] = []
    step = gen.next

    def watched_step():
        result = step()
        seen.append([len(lane) for lane in gen._generation_batch.lanes])
        return result

    gen.next = watched_step
    _, laned = run(gen, remove_long_at=40)
    assert any(len(sizes) > 1 for sizes in seen)
    (cache_a, tokens_a), (cache_b, tokens_b) = whole, laned
    assert tokens_b == tokens_a
    for a, b in zip(cache_a, cache_b, strict=True):
        assert a.offset == b.offset
        # Equal up to rounding: attention over a padded batch sums its terms in
        # another order.
        assert np.allclose(np.array(a.state[0][..., : a.offset, :]),
                           np.array(b.state[0][..., : b.offset, :]), atol=1e-4)


def test_the_lanes_are_off_at_zero_and_on_a_generator_with_rows(model_path):
    assert not isinstance(generator(model_path, lane_padding=0)._generation_batch, DecodeLanes)
    gen = generator(model_path, lane_padding=0)
    gen.insert([SHORT[0]], max_tokens=[5])
    gen.next()
    gen.next()
    assert not install_decode_lanes(gen, 256)
    mx.clear_cache()


# ------------------------------------------------------------ the engine


def engine_with_lanes(model_path: str, padding: int):
    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core

    return make_engine_core(ServerConfig(model=model_path, decode_lane_padding=padding,
                                         prefill_step_size=64), model_path)


def drive(core, arrivals: dict[int, list], *, abort_after: dict[int, int] | None = None,
          on_abort=None) -> dict:
    """Every request's tokens, failure and how many times it ended; ``arrivals`` by step,
    ``abort_after``: a request aborted once it has that many tokens (``on_abort(core)``
    called then)."""
    from runtime.messages import Abort

    seen: dict[int, dict] = {}
    aborts = dict(abort_after or {})
    for step in range(2000):
        for s in arrivals.pop(step, ()):
            for request_id in (s.request_id, *s.choice_ids):
                seen[request_id] = {"tokens": [], "failed": None, "ended": 0}
            core.handle_command(s)
        for request_id, count in list(aborts.items()):
            if len(seen.get(request_id, {}).get("tokens", ())) >= count:
                if on_abort is not None:
                    on_abort(core)
                core.handle_command(Abort(request_id=request_id))
                del aborts[request_id]
        out = core.step()
        for e in out.tokens:
            seen[e.request_id]["tokens"].append(e.token)
        for e in out.failed:
            seen[e.request_id]["failed"] = e.message
        for request_id in out.terminal_ids():
            seen[request_id]["ended"] += 1
        if not arrivals and not core.has_work:
            return seen
    raise AssertionError("the engine did not finish its requests")


def test_the_engine_serves_sampled_constrained_and_aborted_rows_across_lanes(tiny_model_path):
    """The engine as the server builds it, lanes opening at 32 positions of padding: long
    prompts join short rows sampled every way; a constrained row validates, a seeded row
    repeats its tokens, three choices of one prompt decode, an aborted lane row ends
    once and the others go on."""
    import json

    import attrs
    import jsonschema

    from runtime.messages import SamplingParams
    from tests.test_engine_sampling import CORPUS, MIXED, schema_spec, submit

    core = engine_with_lanes(tiny_model_path, 32)
    tokenizer = core.handle.tokenizer
    lanes = core._batch._generation_batch
    assert isinstance(lanes, DecodeLanes)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    alone = drive(core, {0: [submit(core, 1, "pick a word", sampling=seeded, max_tokens=24)]})
    long_text = " ".join(f"word{i % 97}" for i in range(400))
    shorts = [submit(core, 10 + i, f"short {i}", sampling=p, max_tokens=64)
              for i, p in enumerate(MIXED)]
    longs = [
        submit(core, 2, long_text, max_tokens=40),
        submit(core, 3, long_text + " json", max_tokens=96,
               constraint=schema_spec(tokenizer, CORPUS["string_enum"])),
        submit(core, 4, "pick a word", sampling=seeded, max_tokens=24),
        submit(core, 5, long_text + " again", max_tokens=200),
        attrs.evolve(submit(core, 6, long_text + " twice", max_tokens=20,
                            sampling=SamplingParams(temperature=0.9, seed=5)),
                     choice_ids=(7, 8)),  # n = 3: one prefill, three rows
    ]
    lanes_at_abort = []
    seen = drive(core, {0: shorts, 3: longs}, abort_after={5: 5},
                 on_abort=lambda core: lanes_at_abort.append(core.stats().decode_lanes))
    assert lanes_at_abort[0] > 1  # the aborted row decoded in a lane of its own
    assert lanes.opened >= 1  # the long prompts decoded beside the short rows
    assert seen[4]["tokens"] == alone[1]["tokens"]
    eos = set(tokenizer.eos_token_ids)
    jsonschema.validate(json.loads(tokenizer.decode(
        [t for t in seen[3]["tokens"] if t not in eos])), CORPUS["string_enum"])
    assert all(r["ended"] == 1 for r in seen.values())
    assert all(r["failed"] is None for i, r in seen.items() if i != 5)
    assert 5 <= len(seen[5]["tokens"]) < 200
    assert all(len(seen[i]["tokens"]) == 20 or seen[i]["tokens"][-1] in eos for i in (6, 7, 8))
    assert len(lanes) == 0 and core.batch_sampler.registered == 0
    stats = core.stats()  # what /metrics reports
    assert stats.decode_lanes == 0 and stats.decode_lanes_opened == lanes.opened
