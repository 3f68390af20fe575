"""A request aborted while its prompt is prefilled leaves what it computed in the prompt cache.

The engine core on the tiny real model: a prompt aborted after a few prefill
chunks stores its computed part; the same prompt sent again starts from it,
reports it as cached and produces the very tokens it produces computed whole;
a request waiting behind the aborted one's prefix starts from it too; nothing
is kept below the floor, with the setting off, or for a request aborted before
its prompt began. A sequence preempted for the KV budget leaves its prompt and
reply so far, whatever the floor, and its resumption starts from them.
"""

from __future__ import annotations

import random

import pytest

from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.messages import Abort, SamplingParams, Submit
from tests.test_engine_sampling import run

STEP = 64  # prefill chunk: a prompt of several hundred tokens takes several steps


def submit(request_id: int, *segments, max_tokens: int = 6) -> Submit:
    """A prompt of ``segments``: one is a user message, two a system prompt and one."""
    types = ("user",) if len(segments) == 1 else ("system", "user")
    return Submit(
        request_id=request_id,
        prompt=tuple(t for s in segments for t in s),
        segments=tuple(tuple(s) for s in segments),
        segment_types=types,
        max_tokens=max_tokens,
        sampling=SamplingParams(),
    )


def core_for(tiny_model_path, floor: int):
    config = ServerConfig(
        model=tiny_model_path,
        prefill_step_size=STEP,
        admission_window_ms=0,
        prompt_cache_min_reuse=16,
        shared_prefill_min_tokens=32,
        aborted_prefill_min_tokens=floor,
    )
    return make_engine_core(config, tiny_model_path)


@pytest.fixture(scope="module")
def cores(tiny_model_path):
    return {floor: core_for(tiny_model_path, floor) for floor in (0, 100)}


def tokens_of(core, n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    vocab = core.handle.info.vocab_size
    return tuple(rng.randrange(10, vocab - 10) for _ in range(n))


def prefill_then_abort(core, request: Submit, steps: int):
    """Submit ``request``, run ``steps`` engine steps, abort it; the outputs of the step
    that applies the abort, and the prompt progress the steps reported."""
    core.handle_command(request)
    done = 0
    for _ in range(steps):
        out = core.step()
        assert not out.tokens, "the prompt should still be prefilling"
        done = max([p.done for p in out.progress if p.request_id == request.request_id] + [done])
    core.handle_command(Abort(request_id=request.request_id))
    out = core.step()
    assert [a.request_id for a in out.aborted] == [request.request_id]
    return out, done


def started_cached(core, request: Submit) -> tuple[int, list[int]]:
    cached = {}

    def on_step(core, out, calls):
        cached.update({s.request_id: s.cached_tokens for s in out.started})

    seen = run(core, [request], on_step=on_step)
    assert seen[request.request_id]["failed"] is None
    return cached[request.request_id], seen[request.request_id]["tokens"]


def test_a_retry_resumes_an_aborted_prefill_and_answers_as_if_computed_whole(cores):
    core = cores[100]
    prompt = tokens_of(core, 500, seed=1)
    before = core.stats()
    _, done = prefill_then_abort(core, submit(1, prompt), steps=3)
    assert done == 3 * STEP
    stats = core.stats()
    assert stats.aborted_prefills_kept == before.aborted_prefills_kept + 1
    assert stats.aborted_prefill_tokens_kept == before.aborted_prefill_tokens_kept + done

    computed_before = core.counters.prompt_tokens_computed
    cached, resumed = started_cached(core, submit(2, prompt))
    assert cached == done
    assert core.counters.prompt_tokens_computed - computed_before == len(prompt) - done

    # The same prompt computed whole, on a core that keeps nothing of aborts.
    whole_core = cores[0]
    assert started_cached(whole_core, submit(3, prompt)) == (0, resumed)


def test_nothing_is_kept_below_the_floor_when_off_or_before_the_prompt_began(cores):
    for floor, steps, seed in ((100, 1, 2), (0, 3, 3)):  # 64 tokens < 100; off
        core = cores[floor]
        prompt = tokens_of(core, 400, seed=seed)
        kept = core.stats().aborted_prefills_kept
        prefill_then_abort(core, submit(10 + seed, prompt), steps=steps)
        assert core.stats().aborted_prefills_kept == kept
        assert started_cached(core, submit(20 + seed, prompt))[0] == 0

    # Aborted before any step: it never reached the generator's prompt batch.
    core = cores[100]
    prompt = tokens_of(core, 400, seed=4)
    kept = core.stats().aborted_prefills_kept
    prefill_then_abort(core, submit(30, prompt), steps=0)
    assert core.stats().aborted_prefills_kept == kept


def test_a_request_waiting_behind_an_aborted_prefix_starts_from_what_it_computed(cores):
    core = cores[100]
    system, tail = tokens_of(core, 400, seed=5), tokens_of(core, 20, seed=6)
    core.handle_command(submit(40, system, (11, 12, 13)))
    core.handle_command(submit(41, system, tail))  # waits for the leader's system prompt
    for _ in range(3):
        core.step()
    core.handle_command(Abort(request_id=40))
    cached, tokens = {}, []
    for _ in range(200):
        out = core.step()
        cached.update({s.request_id: s.cached_tokens for s in out.started})
        tokens += [e.token for e in out.tokens if e.request_id == 41]
        if not core.has_work:
            break
    assert not core.has_work
    assert cached[41] == 3 * STEP
    # Its answer is the one it gives computed whole.
    assert started_cached(cores[0], submit(42, system, tail)) == (0, tokens)


def test_a_preempted_sequence_leaves_its_prompt_and_reply_cached_and_resumes_from_them(cores):
    """The KV budget's preemption: the sequence's KV, its reply so far included, goes to
    the prompt cache whatever the floor, and the request that resumes it (its prompt and
    reply as the prompt) starts from it and goes on as the whole sequence would."""
    from runtime.messages import AbortReason

    core = cores[0]  # aborted prefills are not kept here: a preempted sequence is
    eos = core.handle.tokenizer.eos_token_ids
    never_end = SamplingParams(logit_bias=tuple((e, -100.0) for e in eos))

    def request(request_id, prompt, reply=(), max_tokens=30):
        segments = (prompt, tuple(reply)) if reply else (prompt,)
        return Submit(
            request_id=request_id, prompt=prompt + tuple(reply), segments=segments,
            segment_types=("user", "assistant")[: len(segments)], max_tokens=max_tokens,
            sampling=never_end,
        )

    def reply_then_abort(request_id, prompt, reason):
        core.handle_command(request(request_id, prompt))
        reply = []
        while len(reply) < 10:
            reply += [e.token for e in core.step().tokens if e.request_id == request_id]
        core.handle_command(Abort(request_id=request_id, reason=reason))
        out = core.step()
        assert [a.request_id for a in out.aborted] == [request_id]
        return tuple(reply)

    prompt = tokens_of(core, 300, seed=7)
    reply = reply_then_abort(60, prompt, AbortReason.PREEMPTED)
    cached, rest = started_cached(core, request(61, prompt, reply, max_tokens=30 - len(reply)))
    assert cached == len(prompt) + len(reply) - 1  # all of it: the last token is fed again
    # Its reply goes on as the sequence's own would have (greedy), computed whole.
    whole_core = cores[100]
    assert started_cached(whole_core, request(62, prompt))[1] == list(reply) + rest

    # A client that left (any other reason) leaves no reply in the cache.
    other = tokens_of(core, 300, seed=8)
    reply = reply_then_abort(63, other, AbortReason.CLOSED)
    cached, _ = started_cached(core, request(64, other, reply, max_tokens=30 - len(reply)))
    assert cached <= len(other)
