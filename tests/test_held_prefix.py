"""A decoding batch's layers holding their rows' shared prefix once (runtime.held_prefix),
against real MLX (CPU) and a tiny model on the compiled decode path: decode steps give
the logits of the same batch holding the prefix in every row, through rows leaving and
the layers growing past their block; a row extracted is its whole KV; the batch holds
the prefix once."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from runtime.compiled_decode import install_compiled_decode
from runtime.held_prefix import held_prefix, hold_prefix_once

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
