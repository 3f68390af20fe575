"""bench/held_prefix_step.py on the CPU with the tiny model: both layouts decode, and
the batch holding the prefix once holds less."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import held_prefix_step as bench  # noqa: E402


def test_both_layouts_are_timed_and_the_held_one_holds_the_prefix_once(tiny_model_path,
                                                                        tmp_path):
    out = tmp_path / "held.json"
    assert bench.main(["--model", tiny_model_path, "--rows", "3", "--prefix", "300",
                       "--own", "40", "--steps", "2", "--rounds", "1",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    layouts = result["layouts"]
    assert set(layouts) == {"held", "every-row"}
    assert result["compiled_layers"] > 0
    for layout in layouts.values():
        assert layout["step_ms_fastest"] > 0 and layout["tokens_per_s"] > 0
    # Per layer: the prefix once and 3 rows of 40 own keys, against 3 rows of 340.
    held, every_row = layouts["held"]["kv_bytes"], layouts["every-row"]["kv_bytes"]
    assert held * 3 * 340 == every_row * (300 + 3 * 40)
