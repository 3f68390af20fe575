"""bench/batch_memory.py on the CPU: every case runs both ways, and a layer at a time
holds less beyond the batch than at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import batch_memory as bench  # noqa: E402

from runtime import batch_layers  # noqa: E402


def test_batch_memory_holds_less_a_layer_at_a_time(tmp_path):
    large = batch_layers.large_batch_bytes
    out = tmp_path / "memory.json"
    assert bench.main(["--rows", "6", "--tokens", "256", "--reps", "1", "--out", str(out)]) == 0
    assert batch_layers.large_batch_bytes is large  # given back
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"join", "leave", "grow", "align"}
    for case, ways in cases.items():
        once, in_turn = ways["at-once"], ways["layer-at-a-time"]
        assert once["batch_gb"] == in_turn["batch_gb"] > 0
        # a layer is 1/28 of the batch: a layer at a time holds a few layers at most
        assert in_turn["excess_gb"] < 0.15 * in_turn["batch_gb"], case
        assert in_turn["excess_gb"] < once["excess_gb"], case
