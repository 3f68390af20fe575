"""``SerialGenerator``: mlx-lm's ``stream_generate`` behind the batch generator's interface,
on the real tiny model: the same tokens as mlx-lm's ``BatchGenerator`` through the same
``EngineCore`` path, one sequence at a time and one token per ``next()``, aborts, the
finished cache kept under exactly the tokens it holds, and a failure that is one request's.
"""

from __future__ import annotations

import attrs
import pytest

from runtime.engine.core import EngineCore
from runtime.engine.serial import SerialGenerator
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.messages import FinishReason, SamplingParams, Submit
from runtime.prompt_cache_store import PromptCacheStore


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    from mlx_lm import load

    return load(tiny_model_path)


def submit(request_id: int, prompt: list[int], max_tokens: int) -> Submit:
    return Submit(
        request_id=request_id,
        prompt=tuple(prompt),
        segments=(tuple(prompt),),
        segment_types=("user",),
        sampling=SamplingParams(),
        max_tokens=max_tokens,
    )


def engine(loaded, make_generator, **kwargs) -> EngineCore:
    from mlx_lm.generate import make_stop_sequences

    model, tokenizer = loaded
    return EngineCore(
        LoadedModel(
            model=model,
            tokenizer=tokenizer,
            info=ModelInfo(model_key="tiny", vocab_size=len(tokenizer)),
        ),
        batch_generator_factory=make_generator,
        prompt_cache=PromptCacheStore(max_size=8),
        stop_sequences=make_stop_sequences(tokenizer),
        **kwargs,
    )


def run(core: EngineCore, submits: list[Submit], steps: int = 200) -> dict:
    """Every event of each request: tokens, finish reasons, started, failed."""
    seen: dict[int, dict] = {s.request_id: {"tokens": [], "reasons": []} for s in submits}
    for s in submits:
        core.handle_command(s)
    for _ in range(steps):
        out = core.step()
        for e in out.started:
            seen[e.request_id]["cached"] = e.cached_tokens
        for e in out.tokens:
            seen[e.request_id]["tokens"].append(e.token)
            seen[e.request_id]["reasons"].append(e.finish_reason)
        for e in out.failed:
            seen[e.request_id]["failed"] = e.message
        if not core.has_work:
            break
    return seen


def prompts(tokenizer) -> list[list[int]]:
    texts = ["the weather in Paris", "say a word", "add 3 and 4"]
    return [list(tokenizer.encode(t)) for t in texts]


def test_the_serial_path_gives_the_batch_generators_tokens(loaded):
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = loaded
    for i, prompt in enumerate(prompts(tokenizer)):
        batched = run(engine(loaded, lambda: BatchGenerator(model)), [submit(i, prompt, 10)])
        serial = run(engine(loaded, lambda: SerialGenerator(model, tokenizer)),
                     [submit(i, prompt, 10)])
        assert serial[i]["tokens"] == batched[i]["tokens"]
        reasons = serial[i]["reasons"]
        assert reasons[:-1] == [None] * (len(reasons) - 1)
        assert type(reasons[-1]) is FinishReason
        assert reasons[-1] == batched[i]["reasons"][-1]


def test_one_sequence_at_a_time_one_token_per_next(loaded):
    model, tokenizer = loaded
    gen = SerialGenerator(model, tokenizer)
    a, b = prompts(tokenizer)[:2]
    uids = gen.insert_segments([[a[:2], a[2:]], [b]], max_tokens=[3, 2], all_tokens=[[], []])
    assert uids == [0, 1]
    served = []
    first_prompt = None
    for _ in range(10):
        prompt_responses, generated = gen.next()
        if first_prompt is None:
            first_prompt = prompt_responses
        assert len(generated) <= 1
        served += [(r.uid, r.finish_reason) for r in generated]
    assert served == [(0, None), (0, None), (0, "length"), (1, None), (1, "length")]
    # The whole prompt is processed in the first call, counted from 0 to its length.
    assert first_prompt[0].progress == (0, len(a)) and first_prompt[-1].progress == (len(a),) * 2
    assert not any(r.end_of_segment and not r.end_of_prompt for r in first_prompt)
    assert gen.next() == ([], [])


def test_remove_drops_a_waiting_sequence_and_stops_the_running_one(loaded):
    model, tokenizer = loaded
    gen = SerialGenerator(model, tokenizer)
    a, b, c = prompts(tokenizer)
    gen.insert_segments([[a], [b], [c]], max_tokens=[50, 3, 50])
    assert [r.uid for r in gen.next()[1]] == [0]
    assert gen.prompt_cache_nbytes > 0  # the running sequence's cache
    gen.remove([0, 2])
    uids = []
    for _ in range(6):
        uids += [r.uid for r in gen.next()[1]]
    assert uids == [1, 1, 1]
    gen.close()
    assert gen.next() == ([], []) and gen.prompt_cache_nbytes == 0


@pytest.mark.parametrize("draft", [False, True])
def test_a_finished_cache_holds_exactly_its_tokens(loaded, draft):
    model, tokenizer = loaded
    gen = SerialGenerator(model, tokenizer, draft_model=model if draft else None)
    prompt = prompts(tokenizer)[0]
    gen.insert_segments([[prompt]], max_tokens=[6])
    generated = []
    for _ in range(8):
        generated += gen.next()[1]
    last = generated[-1]
    assert last.finish_reason == "length" and len(generated) == 6
    tokens = prompt + [r.token for r in generated]
    assert last.all_tokens == tokens[: len(last.all_tokens)]
    assert len(last.all_tokens) >= len(prompt) + 5
    assert len(last.prompt_cache) == len(model.layers) * (2 if draft else 1)
    assert {c.offset for c in last.prompt_cache} == {len(last.all_tokens)}


def test_a_finished_serial_sequence_is_reused_by_the_next(loaded):
    model, tokenizer = loaded
    core = engine(loaded, lambda: SerialGenerator(model, tokenizer))
    prompt = prompts(tokenizer)[0]
    first = run(core, [submit(1, prompt, 5)])
    entries = core.stats().prompt_cache_entries
    assert entries == 1
    again = run(core, [submit(2, prompt, 5)])
    assert again[2]["cached"] == len(prompt) - 1  # all but the one token given back
    assert again[2]["tokens"] == first[1]["tokens"]


def test_a_failing_sequence_fails_alone_and_the_generator_stays(loaded):
    model, tokenizer = loaded
    made = []

    def factory():
        made.append(SerialGenerator(model, tokenizer))
        return made[-1]

    def sampler_for(params: SamplingParams):
        if params.seed == 13:
            def broken(logprobs):
                raise RuntimeError("sampler broke")

            return broken
        return None

    core = engine(loaded, factory, sampler_factory=sampler_for)
    a, b = prompts(tokenizer)[:2]
    bad = attrs.evolve(submit(1, a, 4), sampling=SamplingParams(temperature=1.0, seed=13))
    seen = run(core, [bad, submit(2, b, 4)])
    assert "sampler broke" in seen[1]["failed"] and seen[1]["tokens"] == []
    assert len(seen[2]["tokens"]) == 4 and "failed" not in seen[2]
    assert len(made) == 1  # not rebuilt: the failure was one sequence's
