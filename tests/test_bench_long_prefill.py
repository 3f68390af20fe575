"""bench/long_prefill.py's summary: the streams' gaps before, during and after a long
prefill, and the ratios the interleaving target is judged by."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import long_prefill  # noqa: E402


def ticks(start: float, gap: float, until: float) -> list[float]:
    times, t = [], start
    while t <= until:
        times.append(round(t, 6))
        t += gap
    return times


def stream(before_gap: float, during_gap: float, after_gap: float) -> dict:
    """Chunks every ``before_gap`` s up to 10 s, every ``during_gap`` while the long
    prompt is prefilled (10-12 s), then every ``after_gap`` up to 20 s."""
    chunks = ticks(1.0, before_gap, 10.0)
    chunks += ticks(chunks[-1] + during_gap, during_gap, 12.0)
    chunks += ticks(chunks[-1] + after_gap, after_gap, 20.0)
    return {"chunks": chunks}


def summary(streams: list[dict]) -> dict:
    long_rec = {"sent": 10.0, "chunks": [12.0, 12.5]}  # its first token at 12 s, last 12.5
    probe_rec = {"sent": 10.5, "chunks": [12.2, 12.6]}
    ns = argparse.Namespace(long_tokens=30000)
    return long_prefill.summarize(streams, long_rec, probe_rec, ns)


def test_the_window_after_the_prefill_is_a_second_median_without_it():
    """A host in its fast mode before the prompt (10 ms) and its slow one after it (20
    ms), and the other way round: the ratio to the median before follows whichever mode
    the window before caught (4x, 2x), the ratio to the gaps before and after together
    their median, the window with more gaps weighing more."""
    result = summary([stream(0.010, 0.040, 0.020) for _ in range(4)])
    assert result["itl_before_p50_ms"] == pytest.approx(10.0, abs=0.01)
    assert result["itl_during_p99_ms"] == pytest.approx(40.0, abs=0.01)
    assert result["p99_during_over_p50_before"] == pytest.approx(4.0, abs=0.01)
    assert result["itl_after_p50_ms"] == pytest.approx(20.0, abs=0.01)
    # The after window starts once the probe's last chunk (12.6 s) is in: 7.4 s of
    # 20 ms gaps a stream (370), against 9 s of 10 ms gaps before (900).
    assert 4 * 369 <= result["gaps_after"] <= 4 * 372
    assert result["p99_during_over_p50_without"] == pytest.approx(4.0, abs=0.01)
    slow_before = summary([stream(0.020, 0.040, 0.010) for _ in range(4)])
    assert slow_before["p99_during_over_p50_before"] == pytest.approx(2.0, abs=0.01)
    # 450 gaps of 20 ms before, about 740 of 10 ms after: the median is 10 ms.
    assert slow_before["p99_during_over_p50_without"] == pytest.approx(4.0, abs=0.01)


def test_the_median_without_the_prefill_weighs_both_windows_by_their_gaps():
    """Half the streams' gaps before at 10 ms, as many after at 30 ms: the median of all
    lies between the two windows' own."""
    fast = [{"chunks": ticks(1.0, 0.010, 10.0) + ticks(10.1, 0.100, 12.0)
             + ticks(12.7, 0.030, 12.7 + 0.030 * 900)} for _ in range(2)]
    result = summary(fast)
    assert result["itl_before_p50_ms"] == pytest.approx(10.0, abs=0.01)
    assert result["itl_after_p50_ms"] == pytest.approx(30.0, abs=0.01)
    without = result["itl_during_p99_ms"] / result["p99_during_over_p50_without"]
    assert 10.0 <= without <= 30.0


def test_no_after_window_without_a_first_token():
    """A long prompt that never answered leaves no window after it (and no ratio)."""
    long_rec = {"sent": 10.0}
    ns = argparse.Namespace(long_tokens=30000)
    result = long_prefill.summarize([stream(0.010, 0.040, 0.020)], long_rec, {}, ns)
    assert result["gaps_after"] == 0 and result["itl_after_p50_ms"] is None
    assert result["p99_during_over_p50_without"] is None
