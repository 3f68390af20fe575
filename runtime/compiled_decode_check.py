"""The compiled decode path's check of itself against mlx-lm's layers, at load.

Owns ``check_compiled_decode(model, vocab_size, max_rows)``. It receives a
model that ``runtime.compiled_decode.install_compiled_decode`` has given the
compiled path, on the thread and stream that will step it, before its first
step. It prefills a short fixed prompt per row through mlx-lm's own path
(single-sequence caches from ``make_prompt_cache``), merges the rows' caches
into a batch cache as ``BatchGenerator`` does, and decodes ``DECODE_STEPS``
fixed tokens twice from identical copies of that cache: once with every layer
as mlx-lm builds it (each compiled pair's ``broken`` flag set, the fallback a
failing compiled call takes) and once through the compiled pairs; at one row
and at two (rows of different lengths: left padding) where ``max_rows``
allows two. The logits of the two passes must agree within
``TOLERANCE[dtype]``.

It emits one log line: INFO with the largest difference where they agree;
WARNING (the layer kinds, the difference and the tolerance) where they differ
beyond it, where a compiled call raised or where the check itself could not
run; then every compiled pair of the model is turned off (``broken``), so its
layers decode as mlx-lm builds them. It returns whether the compiled path
stays on.

It leaves nothing the server uses changed: its caches are its own and dropped,
the weights are untouched, and the traces it makes are of batch sizes 1 and 2,
which the load traces anyway (``trace_batch_sizes``) unless
``--lazy-decode-traces``, where the first steps would have made them.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from runtime.compiled_decode import compiled_layouts

log = logging.getLogger(__name__)

PROMPT_LENGTHS = (12, 9)  # the rows' prompts: different lengths, so the batch is left-padded
DECODE_STEPS = 2  # the second step also reads the keys and values the first one wrote

# The largest difference the two passes' logits may show, relative to the largest
# reference logit, by the logits' dtype. Both passes run the same matmul, norm, RoPE and
# attention kernels on the same inputs, and MLX's fused kernels round each operation to
# its dtype as the unfused ones do: an unchanged layer gives the very logits (measured:
# 0 in float32, float16, bfloat16 and 4-bit on the CPU). The tolerance is there for a
# computation mlx-lm reorders without changing its maths, whose rounding the layers above
# carry to the logits: float32 1e-4 (tests/test_compiled_decode.py holds the CI's logits
# to 1e-5; the room is for deeper models); float16 and bfloat16 four units of their
# epsilon (2**-10, 2**-7). Measured on the CPU's tiny random models, a changed layer moves
# the logits far more: a RoPE position off by one 0.2-1, the attention's output 10% larger
# 0.045-0.057 (1% larger: 0.005 in float32 and float16, caught; 0.013 in bfloat16, within
# that dtype's own rounding and not caught).
TOLERANCE = {"float32": 1e-4, "float16": 4 * 2**-10, "bfloat16": 4 * 2**-7}
DEFAULT_TOLERANCE = TOLERANCE["bfloat16"]  # logits of any other dtype


def check_compiled_decode(model: Any, vocab_size: int, max_rows: int) -> bool:
    """Compare the compiled decode step of ``model`` with mlx-lm's; turn it off where
    they differ. ``vocab_size``: the prompts' ids stay below it; ``max_rows``: the
    largest batch the server decodes (1: the check decodes one row only).
    Returns whether the compiled path stays on."""
    layouts = compiled_layouts(model)
    if not layouts:
        return False
    pairs = [layer._compiled_decode for layer in layouts]
    kinds = ", ".join(sorted({_kind(layer) for layer in layouts}))
    started = time.perf_counter()
    for pair in pairs:
        pair.quiet = True
    try:
        difference, tolerance = _compare(model, pairs, vocab_size, max_rows)
    except Exception as exc:  # mlx-lm's own pass, or the caches, failed: nothing to trust
        return _turn_off(pairs, f"the compiled decode path of {kinds} could not be checked "
                                f"({type(exc).__name__}: {exc})")
    finally:
        for pair in pairs:
            pair.quiet = False
    failed = next((pair.failure for pair in pairs if pair.broken), None)
    if failed is not None:
        return _turn_off(pairs, f"the compiled decode step of {kinds} raised "
                                f"({type(failed).__name__}: {failed})")
    if not difference <= tolerance:  # NaN too
        return _turn_off(pairs, f"the compiled decode step of {kinds} differs from mlx-lm's: "
                                f"logits apart by {difference:.3g} of their size, "
                                f"tolerance {tolerance:.3g}")
    log.info("compiled decode step of %s checked against mlx-lm's: logits apart by %.3g of "
             "their size (tolerance %.3g), %.2f s",
             kinds, difference, tolerance, time.perf_counter() - started)
    return True


def _kind(layer: Any) -> str:
    base = type(layer).__mro__[1]  # the compiled subclass's base: mlx-lm's block class
    return f"{base.__module__.rpartition('.')[2]}.{base.__name__}"


def _turn_off(pairs: list[Any], why: str) -> bool:
    for pair in pairs:
        pair.broken = True
    log.warning("%s; the model decodes as mlx-lm builds it", why)
    return False


def _compare(model: Any, pairs: list[Any], vocab_size: int, max_rows: int) -> tuple[float, float]:
    """The largest relative difference of the two passes' logits, and its tolerance."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    rows = PROMPT_LENGTHS[: max(1, min(max_rows, len(PROMPT_LENGTHS)))]
    prefilled = []
    for row, length in enumerate(rows):  # one sequence at a time: mlx-lm's path
        cache = make_prompt_cache(model)
        model(mx.array([_ids(row, length, vocab_size)]), cache=cache)
        mx.eval([c.state for c in cache])
        prefilled.append(cache)
    worst, tolerance = 0.0, 0.0
    for batch in sorted({1, len(rows)}):
        merged = [c.merge([row[i] for row in prefilled[:batch]])
                  for i, c in enumerate(prefilled[0])]
        steps = [mx.array([[_ids(row + 5, 1, vocab_size, step)[0]] for row in range(batch)])
                 for step in range(DECODE_STEPS)]
        for pair in pairs:
            pair.broken = True  # mlx-lm's layers
        reference = _decode(model, copy.deepcopy(merged), steps)
        for pair in pairs:
            pair.broken = False
        compiled = _decode(model, merged, steps)
        if any(pair.broken for pair in pairs):  # a compiled call raised
            return worst, tolerance
        tolerance = TOLERANCE.get(str(reference.dtype).rpartition(".")[2], DEFAULT_TOLERANCE)
        reference, compiled = reference.astype(mx.float32), compiled.astype(mx.float32)
        size = mx.abs(reference).max().item() or 1.0
        difference = mx.abs(compiled - reference).max().item() / size
        if difference != difference:  # NaN logits on one side: no agreement
            return difference, tolerance
        worst = max(worst, difference)
    return worst, tolerance


def _decode(model: Any, cache: list[Any], steps: list[Any]) -> Any:
    import mlx.core as mx

    logits = mx.concatenate([model(tokens, cache=cache) for tokens in steps], axis=1)
    mx.eval(logits)
    return logits


def _ids(row: int, length: int, vocab_size: int, start: int = 0) -> list[int]:
    """Fixed token ids below ``vocab_size``, different per row and position."""
    return [(7 + 31 * row + 13 * (start + i)) % vocab_size for i in range(length)]
