"""A decoding batch's layers holding their rows' shared prefix once (runtime.held_prefix),
against real MLX (CPU) and a tiny model on the compiled decode path: decode steps give
the logits of the same batch holding the prefix in every row, through rows leaving and
the layers growing past their block; a row extracted is its whole KV; the batch holds
the prefix once."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from runtime.compiled_decode import install_compiled_decode
from runtime.held_prefix import held_prefix, hold_prefix_once, prefix_released, shared_length

PREFIX = [(7 * i + 3) % 200 + 1 for i in range(40)]
OWN = [[5, 9, 12, 40, 41, 7], [3, 3, 8], [17, 2, 99, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model(tiny_model_path):
    loaded, _ = load(tiny_model_path)
    assert install_compiled_decode(loaded) == len(loaded.layers)
    return loaded


def prefilled(model, own=OWN) -> list:
    """The rows (the prefix, then each one's own tokens) prefilled as one left-padded
    batch."""
    rows = [PREFIX + tokens for tokens in own]
    longest = max(map(len, rows))
    padding = [longest - len(r) for r in rows]
    cache = [BatchKVCache(padding) for _ in model.layers]
    model(mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def decode(model, cache, steps: int, rows: int, seed: int = 0) -> list:
    """``steps`` decode steps of ``rows`` rows, each fed fixed tokens; their logits."""
    out = []
    for step in range(steps):
        tokens = mx.array([[(seed + 31 * step + 7 * row) % 200 + 1] for row in range(rows)])
        logits = model(tokens, cache=cache)
        mx.eval(logits)
        out.append(np.array(logits))
    return out


def test_decode_steps_give_the_logits_of_each_row_holding_the_prefix(model):
    plain, held = prefilled(model), prefilled(model)
    before = sum(c.nbytes for c in held)
    hold_prefix_once(mx, held, len(PREFIX))
    prefix_bytes = sum(k.nbytes + v.nbytes for k, v in map(held_prefix, held))
    # The prefix once, and each row's own keys (the longest row's; none of the prefix).
    assert all(c.keys.shape[2] == len(OWN[2]) for c in held)
    assert sum(c.nbytes for c in held) + prefix_bytes < before / 2
    for got, want in zip(decode(model, held, 3, 3), decode(model, plain, 3, 3), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_rows_leave_and_the_layers_grow_past_their_block(model):
    plain, held = prefilled(model), prefilled(model)
    hold_prefix_once(mx, held, len(PREFIX))
    keep = mx.array([0, 2])
    for c in plain + held:
        c.filter(keep)
    steps = BatchKVCache.step + 4  # past the first block of the rows' own keys
    got, want = decode(model, held, steps, 2), decode(model, plain, steps, 2)
    assert held[0].keys.shape[2] > BatchKVCache.step
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3, err_msg=f"step {step}")


def test_a_row_extracted_is_its_whole_kv(model):
    plain, held = prefilled(model), prefilled(model)
    hold_prefix_once(mx, held, len(PREFIX))
    decode(model, plain, 2, 3)
    decode(model, held, 2, 3)
    for row in range(3):
        for p, h in zip(plain, held, strict=True):
            whole, ours = p.extract(row), h.extract(row)
            assert ours.offset == whole.offset == len(PREFIX) + len(OWN[row]) + 2
            np.testing.assert_allclose(np.array(ours.keys), np.array(whole.keys),
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.array(ours.values), np.array(whole.values),
                                       rtol=1e-4, atol=1e-4)


def _graph(array) -> str:
    import io

    out = io.StringIO()
    mx.export_to_dot(out, array)
    return out.getvalue()


def test_a_row_s_span_is_read_without_the_whole_row_and_alike(model):
    """``row_span`` of a held layer's extracted row, on either side of the prefix's end
    and across it, is the same slice of the row's whole KV, and reads it from the
    prefix's and the row's own arrays; a layer whose arrays were replaced is read as it
    is now."""
    from runtime.held_prefix import row_span

    plain, held = prefilled(model), prefilled(model)
    hold_prefix_once(mx, held, len(PREFIX))
    decode(model, plain, 2, 3)
    decode(model, held, 2, 3)
    n_prefix = len(PREFIX)
    for row in range(3):
        whole, ours = plain[0].extract(row), held[0].extract(row)
        n = whole.offset
        for start, end in ((0, n), (0, 10), (10, n_prefix), (5, n_prefix + 3), (n_prefix, n),
                           (n_prefix + 2, n)):
            keys, values = row_span(ours, start, end)
            assert keys.shape[2] == end - start
            np.testing.assert_allclose(np.array(keys), np.array(whole.keys[..., start:end, :]),
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.array(values),
                                       np.array(whole.values[..., start:end, :]),
                                       rtol=1e-4, atol=1e-4)
        # Past the prefix, the row's own arrays are read: the concatenation, which its
        # whole keys are, is not in what computes them.
        assert "Concatenate" in _graph(ours.keys)
        assert "Concatenate" not in _graph(row_span(ours, n_prefix + 1, n)[0])
        ours.keys = ours.keys * 0  # replaced: read as it is now
        assert not np.array(row_span(ours, n_prefix, n)[0]).any()
        assert np.array(row_span(whole, 0, n)[0]).shape == np.array(whole.keys).shape


def test_a_held_row_stored_in_the_prompt_cache_comes_back_whole(model):
    """The prompt-cache store keeps a finished held row after the system span it holds
    (read by ``row_span``), and a later turn fetching the row gets its whole KV."""
    from runtime.prompt_cache_store import PromptCacheStore

    plain, held = prefilled(model), prefilled(model)
    hold_prefix_once(mx, held, len(PREFIX))
    decode(model, plain, 2, 3)
    decode(model, held, 2, 3)
    store = PromptCacheStore()
    system = PREFIX[:30]  # a system span shorter than the held prefix
    store.insert_cache("m", system, [p.extract(0) for p in plain], cache_type="system")
    for row in range(3):
        tokens = PREFIX + OWN[row] + [900 + row, 901 + row]  # the decoded two are stand-ins
        store.insert_cache("m", tokens, [h.extract(row) for h in held], cache_type="assistant")
        cache, rest = store.fetch_nearest_cache("m", tokens + [5])
        assert rest == [5]
        for layer, p in zip(cache, plain, strict=True):
            whole = p.extract(row)
            keys, values = (a[..., :layer.offset, :] for a in (layer.keys, layer.values))
            np.testing.assert_allclose(np.array(keys), np.array(whole.keys), rtol=1e-4,
                                       atol=1e-4)
            np.testing.assert_allclose(np.array(values), np.array(whole.values), rtol=1e-4,
                                       atol=1e-4)


def test_a_prefix_given_back_leaves_each_row_holding_it(model):
    """``prefix_released``: each row's prefix right before its own keys again (rows of
    different lengths, one gone), and decode steps give the plain batch's logits."""
    plain, held = prefilled(model), prefilled(model)
    hold_prefix_once(mx, held, len(PREFIX))
    decode(model, plain, 2, 3)
    decode(model, held, 2, 3)
    for c in plain + held:
        c.filter(mx.array([1, 2]))
    prefix_released(mx, held)
    assert all(held_prefix(c) is None and "extract" not in c.__dict__ for c in held)
    for p, h in zip(plain, held, strict=True):
        assert h.offset.tolist() == p.offset.tolist()
        for row in range(2):
            np.testing.assert_allclose(np.array(h.extract(row).keys),
                                       np.array(p.extract(row).keys), rtol=1e-4, atol=1e-4)
    for got, want in zip(decode(model, held, 3, 2), decode(model, plain, 3, 2), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=5))
def test_shared_length_is_the_tokens_all_lists_begin_with(token_lists):
    got = shared_length(token_lists)
    assert all(tokens[:got] == token_lists[0][:got] for tokens in token_lists)
    assert got == min(map(len, token_lists)) or len(
        {tuple(tokens[:got + 1]) for tokens in token_lists}) > 1
    assert shared_length([]) == 0


def test_only_rows_holding_the_same_prefix_join(model):
    held, plain = prefilled(model), prefilled(model, OWN[:1])
    hold_prefix_once(mx, held, len(PREFIX))
    with pytest.raises(ValueError, match="same prefix"):
        held[0].extend(plain[0])
    # Rows split off the same batch (the same prefix arrays) join back.
    other = prefilled(model)
    hold_prefix_once(mx, other, len(PREFIX))
    with pytest.raises(ValueError, match="same prefix"):
        held[0].extend(other[0])  # an equal prefix, but not the same arrays
    for c in other:
        c.held_prefix = held_prefix(held[other.index(c)])
    for mine, theirs in zip(held, other, strict=True):
        mine.extend(theirs)
    assert held[0].keys.shape[0] == 6
    assert [len(s) for s in decode(model, held, 1, 6)] == [6]


def test_what_cannot_hold_a_prefix_is_refused(model):
    held = prefilled(model)
    with pytest.raises(ValueError, match="more than"):
        hold_prefix_once(mx, held, len(PREFIX) + len(OWN[1]))  # row 1 would hold nothing
    with pytest.raises(ValueError, match="at least one"):
        hold_prefix_once(mx, held, 0)
    hold_prefix_once(mx, held, len(PREFIX))
    with pytest.raises(ValueError, match="already"):
        hold_prefix_once(mx, held, 4)
    with pytest.raises(ValueError, match="BatchKVCache"):
        hold_prefix_once(mx, [BatchKVCache([0])], 4)


def _session_submit(tokenizer, request_id: int, system: str, user: str, max_tokens: int):
    """A Submit of a system prompt and one user message, greedy, in two segments."""
    from runtime.messages import SamplingParams, Submit

    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    prompt = tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 enable_thinking=False))
    head = tuple(tokenizer.apply_chat_template(messages[:1], enable_thinking=False))
    cut = len(head) if prompt[:len(head)] == head else 0
    segments = (prompt[:cut], prompt[cut:]) if cut else (prompt,)
    return Submit(request_id=request_id, prompt=prompt, segments=segments,
                  segment_types=("system", "user")[-len(segments):], max_tokens=max_tokens,
                  sampling=SamplingParams())


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "one-batch"])
@pytest.mark.parametrize("is_large", [False, True], ids=["small", "large"])
def test_the_engine_answers_the_same_holding_a_shared_prefix_once(tiny_model_path,
                                                                  monkeypatch, is_large,
                                                                  lanes):
    """The engine as ``make_engine_core`` wires it: sessions over one system prompt arrive
    in waves (the prompt cache hands the later ones its KV), rows leave and join, one is
    aborted, and a request over another system prompt arrives while the batch holds the
    prefix. With decode lanes it decodes in a lane of its own; in one batch, the batch
    gives the prefix back to every row before it joins. With the prefix held once each
    request gets the tokens it gets without. Large: every batch counted large, leaving
    rows' places kept (and filled) too."""
    import runtime.engine.loading as loading
    from runtime import batch_layers, held_prefix
    from runtime.config import ServerConfig
    from tests.test_vacant_rows import engine_run

    system = "You are a careful coding agent. Read files before editing them. " * 12
    other = "Answer in one short sentence, in plain words and no lists. " * 12

    def waves(core):
        tok = core.handle.tokenizer

        def submit(i, user, max_tokens, prompt=system):
            return _session_submit(tok, i, prompt, user, max_tokens)

        return {
            0: [submit(0, "list the files", 40), submit(1, "open main.py", 90)],
            6: [submit(2, "run the tests please", 70)],
            48: [submit(3, "fix the bug", 30)],
            70: [submit(4, "what now", 50, prompt=other)],
            85: [submit(5, "read the docs folder and summarise it", 60)],
        }

    counts = {"held": 0, "released": 0}

    def counted(name, inner):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return inner(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(held_prefix, "hold_prefix_once",
                        counted("held", held_prefix.hold_prefix_once))
    monkeypatch.setattr(held_prefix, "prefix_released",
                        counted("released", held_prefix.prefix_released))
    monkeypatch.setattr(loading, "large_batch_bytes",
                        (lambda mx_: 0) if is_large else (lambda mx_: 1 << 62))
    monkeypatch.setattr(batch_layers, "large_batch_bytes",
                        (lambda mx_: 0) if is_large else (lambda mx_: 1 << 62))
    results = {}
    for tokens in (0, 100):
        config = ServerConfig(model=tiny_model_path, prefill_step_size=64,
                              decode_shared_prefix_tokens=tokens,
                              decode_shared_prefix_budget_share=0,
                              decode_lane_padding=None if lanes else 0)
        core = loading.make_engine_core(config, tiny_model_path)
        results[tokens] = engine_run(core, waves(core), abort_at={40: 1})
        if not tokens:
            assert counts == {"held": 0, "released": 0}
    # Held as the first sessions joined, then each later one stripped as it joined.
    assert counts["held"] >= 2, counts
    assert counts["released"] == (0 if lanes else 1), counts
    if lanes:
        assert core._batch._generation_batch.opened >= 1
    assert results[100] == results[0]
    assert all(r["failed"] is None for r in results[100].values())
    assert len(results[100][5]["tokens"]) == 60


def test_the_engine_stats_count_a_held_prefix_once_and_what_it_saves(model):
    from types import SimpleNamespace

    from runtime.held_prefix import held_prefix_stats

    held, plain = prefilled(model), prefilled(model)
    hold_prefix_once(mx, held, len(PREFIX))
    prefix_bytes = sum(k.nbytes + v.nbytes for k, v in map(held_prefix, held))
    # Three rows, one of them vacant (a negative uid): two sessions share one copy.
    lanes = SimpleNamespace(lanes=[SimpleNamespace(prompt_cache=held, uids=[4, -1, 7]),
                                   SimpleNamespace(prompt_cache=plain, uids=[1, 2, 3]),
                                   SimpleNamespace(prompt_cache=[], uids=[])])
    assert held_prefix_stats(SimpleNamespace(_generation_batch=lanes)) == {
        "held_prefix_bytes": prefix_bytes, "shared_kv_bytes": prefix_bytes}
    assert held_prefix_stats(SimpleNamespace(_generation_batch=None)) == {
        "held_prefix_bytes": 0, "shared_kv_bytes": 0}


def test_a_batch_holds_its_prefix_once_only_where_that_saves_enough_of_the_budget(model):
    """``after_join`` over three sessions sharing the prefix: it holds it where their
    copies less one (two) reach ``min_saving_bytes``, and not a byte short of that; the
    minimum follows the setting's share of the budget the Scheduler admits by."""
    from types import SimpleNamespace

    from runtime.config import ServerConfig
    from runtime.held_prefix import PrefixHolding, kv_bytes_per_token, shared_prefix_min_saving

    def batch():
        caches = prefilled(model)
        tokens = [PREFIX + own for own in OWN]
        return SimpleNamespace(prompt_cache=caches, uids=[0, 1, 2], tokens=tokens)

    copies = 2 * len(PREFIX) * kv_bytes_per_token(batch().prompt_cache)
    assert copies == 2 * sum(k.nbytes + v.nbytes for k, v in
                             map(held_prefix, _held_copy(model))) > 0
    short, enough = batch(), batch()
    refusing = PrefixHolding(len(PREFIX), min_saving_bytes=copies + 1)
    refusing.after_join(mx, short)
    assert refusing.tokens is None and held_prefix(short.prompt_cache[0]) is None
    holding = PrefixHolding(len(PREFIX), min_saving_bytes=copies)
    holding.after_join(mx, enough)
    assert holding.tokens == PREFIX and held_prefix(enough.prompt_cache[0]) is not None
    assert holding.fresh().min_saving_bytes == copies

    config = ServerConfig(model="m", kv_cache_budget_bytes=10_000,
                          decode_shared_prefix_budget_share=0.25)
    known = SimpleNamespace(kv_budget=40_000, kv_bytes_per_token=8)
    assert shared_prefix_min_saving(config, known) == 2_500  # the setting's budget
    config = ServerConfig(model="m", decode_shared_prefix_budget_share=0.5)
    assert shared_prefix_min_saving(config, known) == 20_000  # the model's default
    unknown = SimpleNamespace(kv_budget=40_000, kv_bytes_per_token=0)
    assert shared_prefix_min_saving(config, unknown) == 0  # no budget: held wherever shared


def test_the_budget_share_left_unset_is_none_where_our_kernel_reads_a_held_prefix(
        monkeypatch):
    """Unset, the share is half the budget where a held prefix's attention is operations
    (here, the CPU) and nothing where our CUDA kernel is installed to read it."""
    from types import SimpleNamespace

    from runtime.config import ServerConfig
    from runtime.held_prefix import shared_prefix_min_saving

    config = ServerConfig(model="m", kv_cache_budget_bytes=10_000)
    info = SimpleNamespace(kv_budget=40_000, kv_bytes_per_token=8)
    assert config.decode_shared_prefix_budget_share is None
    assert shared_prefix_min_saving(config, info) == 5_000

    def attention(*args, **kwargs):
        raise AssertionError("not called")

    attention.held_kernel = True
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", attention)
    assert shared_prefix_min_saving(config, info) == 0
    attention.held_kernel = False  # the kernel failed to build: the operations again
    assert shared_prefix_min_saving(config, info) == 5_000


def _held_copy(model) -> list:
    held = prefilled(model)
    hold_prefix_once(mx, held, len(PREFIX))
    return held
