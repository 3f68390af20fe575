"""Prefill groups sized by tokens (``--prefill-group-tokens``), on the real tiny model.

``runtime.mlx_lm_prefill.size_prefill_group`` sets mlx-lm's
``prefill_batch_size`` before each step: beyond ``base`` prompts, more waiting
prompts join while the step's prompt tokens stay within the budget; members
whose prompt is done leave room in the step they go to decoding; the decode
batch's room caps the group. The engine's greedy tokens do not depend on how
prompts were grouped, and the admission window holds requests until they make
such a group.
"""

from __future__ import annotations

import pytest
from mlx_lm.generate import BatchGenerator

from runtime.config import ServerConfig
from runtime.engine.core import EngineCore
from runtime.engine.loading import make_engine_core
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.mlx_environment import PREFILL_SCORES_SHARE, prefill_score_budget
from runtime.mlx_lm_prefill import group_scores, size_prefill_group
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache
from tests.test_engine_sampling import run, submit
from tests.test_properties_scheduler import EOS, VOCAB, make_submit


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from mlx_lm import load

    return load(tiny_model_path)[0]


def generator(model, *, base: int = 2, completion: int = 32, step: int = 2048):
    return BatchGenerator(
        model,
        max_tokens=4,
        completion_batch_size=completion,
        prefill_batch_size=base,
        prefill_step_size=step,
    )


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + j) % 500 + 10 for j in range(length)] for i in range(n)]


def prefilled_uids(prompt_responses) -> set[int]:
    """The uids whose prompt tokens this step processed (not those just done)."""
    return {r.uid for r in prompt_responses if not r.end_of_prompt}


def test_short_prompts_join_while_their_tokens_fit(model):
    gen = generator(model, base=2)
    uids = gen.insert(prompts(6, 10))  # 9 tokens each before the last
    assert size_prefill_group(gen, base=2, token_budget=40) == 4  # 4 x 9 <= 40 < 5 x 9
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == set(uids[:4])


def test_without_a_budget_the_group_is_the_base(model):
    gen = generator(model, base=2)
    uids = gen.insert(prompts(6, 10))
    assert size_prefill_group(gen, base=2, token_budget=0) == 2
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == set(uids[:2])


def test_long_prompts_keep_the_base_group(model):
    gen = generator(model, base=2, step=64)
    uids = gen.insert(prompts(5, 200))  # 64-token chunks: two already exceed 100
    assert size_prefill_group(gen, base=2, token_budget=100) == 2
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == set(uids[:2])
    # Both still prefill (200 tokens in 64-token chunks): nobody else joins.
    assert size_prefill_group(gen, base=2, token_budget=100) == 0


def test_done_members_make_room_in_the_step_they_leave(model):
    """mlx-lm counts a group that finished its prompt against the next group for one
    more step; sized here, the next group prefills in that very step."""
    ours, theirs = generator(model, base=2), generator(model, base=2)
    ours_uids, theirs_uids = ours.insert(prompts(4, 10)), theirs.insert(prompts(4, 10))
    size_prefill_group(ours, base=2, token_budget=0)
    ours.next()
    theirs.next()
    size_prefill_group(ours, base=2, token_budget=0)
    ours_second, _ = ours.next()
    theirs_second, _ = theirs.next()
    assert prefilled_uids(ours_second) == set(ours_uids[2:])
    assert prefilled_uids(theirs_second) == set()  # mlx-lm: one step later
    theirs_third, _ = theirs.next()
    assert prefilled_uids(theirs_third) == set(theirs_uids[2:])


def test_a_long_prompt_waits_for_deep_members_to_finish_their_prefill(model):
    gen = generator(model, base=8, step=64)
    (deep,) = gen.insert(prompts(1, 150))  # chunks of 64, 64, 21, then the last token
    size_prefill_group(gen, base=8, token_budget=4096)
    gen.next()
    long_uids = gen.insert(prompts(3, 200))  # four chunks each
    short_uid = gen.insert(prompts(1, 20))[0]
    # Two steps left for the deep member: the long prompts would be padded to its
    # depth in both, so they wait (and the short one behind them waits its turn).
    for _ in range(2):
        assert size_prefill_group(gen, base=8, token_budget=4096) == 0
        prompt_responses, _ = gen.next()
        assert prefilled_uids(prompt_responses) == {deep}
    # Then they start together, from no depth.
    assert size_prefill_group(gen, base=8, token_budget=4096) == 4
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == {*long_uids, short_uid}


def test_a_long_prompt_joins_members_with_more_steps_left_than_it_needs(model):
    gen = generator(model, base=8, step=64)
    (deep,) = gen.insert(prompts(1, 500))  # eight chunks
    size_prefill_group(gen, base=8, token_budget=4096)
    gen.next()
    (joining,) = gen.insert(prompts(1, 130))  # three chunks: it does not wait seven
    assert size_prefill_group(gen, base=8, token_budget=4096) == 1
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == {deep, joining}


def test_a_short_prompt_joins_deep_members_in_their_last_chunk(model):
    gen = generator(model, base=8, step=64)
    gen.insert(prompts(1, 150))
    for _ in range(2):
        size_prefill_group(gen, base=8, token_budget=4096)
        gen.next()
    (short_uid,) = gen.insert(prompts(1, 20))
    assert size_prefill_group(gen, base=8, token_budget=4096) == 1
    prompt_responses, _ = gen.next()
    assert short_uid in prefilled_uids(prompt_responses)


def test_a_group_keeps_its_deepest_attention_scores_within_the_budget(model):
    gen = generator(model, base=8, step=64)
    uids = gen.insert(prompts(5, 200))  # 200 keys deep at the end: 64 x 200 scores a row
    budget = group_scores(2, 64, 200)
    assert size_prefill_group(gen, base=8, token_budget=4096, score_budget=budget) == 2
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == set(uids[:2])
    # A budget for three (the pacer's smaller chunk does not count: the group may
    # outlive the pacing, so the bound assumes full chunks).
    gen = generator(model, base=8, step=16)
    budget = group_scores(3, 64, 200)
    gen.insert(prompts(5, 200))
    assert size_prefill_group(gen, base=8, token_budget=4096, score_budget=budget,
                              full_chunk=64) == 3


def test_a_lone_prompt_goes_whatever_its_scores(model):
    gen = generator(model, base=8, step=64)
    uids = gen.insert(prompts(3, 200))
    assert size_prefill_group(gen, base=8, token_budget=4096, score_budget=1) == 1
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == {uids[0]}
    # It prefills alone: the others wait, however small their own chunks.
    assert size_prefill_group(gen, base=8, token_budget=4096, score_budget=1) == 0


def test_prompts_past_alone_from_are_prefilled_one_at_a_time(model):
    """Prompts with more than ``alone_from`` tokens to prefill never share a prompt
    batch, to the end of their prefill; shorter ones join as before, in their order."""
    gen = generator(model, base=8, step=64)
    long_uids = gen.insert(prompts(3, 200))
    short_uids = gen.insert(prompts(2, 20))
    seen = []
    for _ in range(14):
        size_prefill_group(gen, base=8, token_budget=4096, alone_from=128)
        prompt_responses, _ = gen.next()
        prefilled = prefilled_uids(prompt_responses)
        if prefilled:
            seen.append(prefilled)
    # Each long prompt in four steps of its own (64, 64, 64, 7); the two short ones, behind
    # the third, go with its first step.
    expected = [{uid} for uid in long_uids[:2] for _ in range(4)]
    expected += [{long_uids[2], *short_uids}] + [{long_uids[2]}] * 3
    assert seen == expected
    # Without the rule, the base group takes them all at once.
    gen = generator(model, base=8, step=64)
    gen.insert(prompts(3, 200))
    gen.insert(prompts(2, 20))
    assert size_prefill_group(gen, base=8, token_budget=4096) == 5  # one group of all
    # A short prompt may go with one long prompt, and joins a long one under way.
    gen = generator(model, base=8, step=64)
    first = gen.insert(prompts(1, 20) + prompts(2, 200))
    assert size_prefill_group(gen, base=8, token_budget=4096, alone_from=128) == 2
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == set(first[:2])
    (short_uid,) = gen.insert(prompts(1, 20))
    size_prefill_group(gen, base=8, token_budget=4096, alone_from=128)
    prompt_responses, _ = gen.next()  # the short one is done; the second long one waits
    assert first[2] not in prefilled_uids(prompt_responses)


def test_a_cached_prefix_counts_in_a_prompt_s_depth(model):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cached = make_prompt_cache(model)
    model(mx.array([prompts(1, 300)[0]]), cache=cached)
    mx.eval([c.state for c in cached])
    gen = generator(model, base=8, step=64)
    gen.insert(prompts(2, 50), caches=[cached, None])  # 350 keys deep, and 50
    assert size_prefill_group(gen, base=8, token_budget=4096,
                              score_budget=group_scores(2, 50, 349)) == 1
    gen = generator(model, base=8, step=64)
    gen.insert(prompts(2, 50), caches=[make_prompt_cache(model), None])
    assert size_prefill_group(gen, base=8, token_budget=4096,
                              score_budget=group_scores(2, 50, 50)) == 2


def test_short_prompts_after_a_deep_prefix_count_only_their_own_queries(model):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for _ in range(3):
        cached = make_prompt_cache(model)
        model(mx.array([prompts(1, 300)[0]]), cache=cached)
        mx.eval([c.state for c in cached])
        caches.append(cached)
    gen = generator(model, base=8, step=64)
    gen.insert(prompts(3, 20), caches=caches)  # 20 queries each, 320 keys deep
    assert size_prefill_group(gen, base=8, token_budget=4096,
                              score_budget=group_scores(3, 20, 320)) == 3


def test_without_a_token_budget_groups_are_the_base_and_still_bounded(model):
    gen = generator(model, base=2)
    uids = gen.insert(prompts(6, 10))
    assert size_prefill_group(gen, base=3, token_budget=None) == 3
    prompt_responses, _ = gen.next()
    assert prefilled_uids(prompt_responses) == set(uids[:3])
    gen = generator(model, base=2)
    gen.insert(prompts(6, 10))
    assert size_prefill_group(gen, base=3, token_budget=None,
                              score_budget=group_scores(2, 10, 10)) == 2


def test_the_score_budget_is_a_share_of_the_device_s_memory():
    class Device:
        def __init__(self, info):
            self.info = info

        def device_info(self):
            return self.info

    memory = 141 << 30
    budget = prefill_score_budget(Device({"memory_size": memory}), heads=16)
    assert budget == int(memory * PREFILL_SCORES_SHARE) // (4 * 16)
    # An H200 and a 0.6B-shaped model: two 32k-token prompts a group, four at 16k.
    assert group_scores(2, 2048, 32768) <= budget < group_scores(3, 2048, 32768)
    assert group_scores(4, 2048, 16384) <= budget < group_scores(5, 2048, 16384)
    assert prefill_score_budget(Device({}), heads=16) is None  # MLX's CPU backend
    # MLX's CUDA backend names the memory differently (an H200's device_info).
    cuda = Device({"total_memory": 150_754_820_096, "free_memory": 132_534_894_592,
                   "architecture": "sm_90", "device_name": "NVIDIA H200"})
    assert prefill_score_budget(cuda, heads=16) == \
        int(150_754_820_096 * PREFILL_SCORES_SHARE) // (4 * 16)


def test_the_decode_batch_caps_the_group(model):
    gen = generator(model, base=2, completion=3)
    gen.insert(prompts(6, 10))
    assert size_prefill_group(gen, base=2, token_budget=1000) == 3


def test_greedy_tokens_do_not_depend_on_the_grouping(tiny_model_path):
    """Twelve prompts of different lengths at once: groups by tokens against mlx-lm's."""
    texts = [f"say {'many ' * (i % 4)}things about the number {i}" for i in range(12)]
    results = {}
    for budget in (0, 4096):
        core = make_engine_core(
            ServerConfig(model=tiny_model_path, prompt_concurrency=2, prefill_group_tokens=budget),
            tiny_model_path,
        )
        # 0: mlx-lm's groups of --prompt-concurrency (only the memory bound applies).
        assert (core._prefill_group.keywords["token_budget"] is None) == (budget == 0)
        prefills = []
        seen = run(
            core,
            [submit(core, i, t, max_tokens=8) for i, t in enumerate(texts)],
            on_step=lambda core, out, calls, prefills=prefills: prefills.append(bool(out.progress)),
        )
        results[budget] = (seen, sum(prefills))
    (plain, plain_prefills), (grouped, grouped_prefills) = results[0], results[4096]
    assert grouped == plain
    assert all(len(s["tokens"]) == 8 or s["reason"] == "stop" for s in grouped.values())
    assert grouped_prefills < plain_prefills


def two_decoding(**window):
    """An engine with a window of an hour (only its other rules end it) and two
    sequences decoding past their first tokens, over the fake generator."""
    factory = FakeBatchGeneratorFactory(vocab=VOCAB, eos_ids={EOS}, completion_batch_size=16)
    core = EngineCore(
        LoadedModel(model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=VOCAB)),
        batch_generator_factory=factory,
        prompt_cache=FakePromptCache(),
        admission_window=3600.0,
        admission_batch=2,
        **window,
    )
    for rid in (1, 2):
        core.handle_command(make_submit(rid, (1, 1), max_tokens=30))
    for _ in range(3):
        core.step()
    return core, factory


def test_the_window_holds_until_the_held_prompts_make_a_group():
    core, factory = two_decoding(admission_tokens=10)
    for rid in (3, 4):  # two held, 8 prompt tokens: not yet a group
        core.handle_command(make_submit(rid, (1, 1, 1, 1), max_tokens=30))
    core.step()
    assert len(factory.current.inserted) == 2
    core.handle_command(make_submit(5, (1, 1, 1, 1), max_tokens=30))  # 12 tokens held
    out = core.step()
    assert len(factory.current.inserted) == 5
    assert {e.request_id for e in out.started} == {3, 4, 5}


def test_the_window_lets_go_when_the_batch_cannot_take_more():
    core, factory = two_decoding(admission_tokens=1000, admission_limit=4)
    for rid in (3, 4):  # 2 decoding + 2 held = the limit: no more can join anyway
        core.handle_command(make_submit(rid, (1, 1), max_tokens=30))
    core.step()
    assert len(factory.current.inserted) == 4


def test_on_the_grid_and_one_long_prompt_at_a_time_the_tokens_are_the_same(tiny_model_path,
                                                                            monkeypatch):
    """The engine as on CUDA (our prefill attention installed: chunks kept on the grid,
    long prompts one at a time) against the CPU's: long and short prompts at once, then
    later turns of more than a chunk after their cached prefixes; every request gets
    the same greedy tokens, and no step prefills two long prompts."""
    import runtime.engine.loading as loading

    first = [f"tell a long story number {i} " + "and then more " * (40 + 7 * i) for i in range(3)]
    first += [f"a short one {i}" for i in range(3)]
    results = {}
    for grid in (False, True):
        if grid:
            monkeypatch.setattr(loading, "install_prefill_attention", lambda mx, full_chunk: True)
        core = make_engine_core(ServerConfig(model=tiny_model_path, prefill_step_size=64,
                                             admission_window_ms=0), tiny_model_path)
        longs_a_step = []

        def count_longs(core, out, calls, longs_a_step=longs_a_step):
            # Long prompts that prefilled in the step (one that finished may leave in the
            # step the next one starts).
            longs_a_step.append(sum(1 for p in out.progress
                                    if p.total > 2 * 64 + 1 and p.done < p.total))

        turn1 = run(core, [submit(core, i, t, max_tokens=6) for i, t in enumerate(first)],
                    on_step=count_longs)
        # Each after its cached prefix, off the grid, with more than a chunk to prefill.
        later = [t + " " + core.handle.tokenizer.decode(turn1[i]["tokens"])
                 + " and now what about this " * 20 for i, t in enumerate(first)]
        turn2 = run(core, [submit(core, 10 + i, t, max_tokens=6) for i, t in enumerate(later)],
                    on_step=count_longs)
        results[grid] = ({i: r["tokens"] for i, r in {**turn1, **turn2}.items()}, longs_a_step)
    (plain, _), (on_grid, longs_a_step) = results[False], results[True]
    assert on_grid == plain and all(len(t) == 6 for t in plain.values())
    assert max(longs_a_step) == 1 and max(results[False][1]) > 1
