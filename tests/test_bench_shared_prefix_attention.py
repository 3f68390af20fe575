"""bench/shared_prefix_attention.py on the CPU: each route runs, and the shared layout
holds the prefix once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import shared_prefix_attention as bench  # noqa: E402


def test_every_route_is_timed_and_the_shared_layout_holds_the_prefix_once(tmp_path):
    out = tmp_path / "shared.json"
    assert bench.main(["--rows", "3", "--prefix", "256", "--own", "64", "--layers", "2",
                       "--heads", "4", "--kv-heads", "2", "--dim", "64", "--reps", "2",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    routes = result["routes"]
    assert {"shared", "grouped", "mlx"} <= set(routes)
    for route in routes.values():
        assert len(route["step_ms"]) == 2 and route["step_ms_fastest"] > 0
    # Per layer, keys and values in bfloat16: the prefix once plus 3 rows of 64, against
    # 3 rows of the prefix and 64 (aligned to 64 keys).
    per_key = 2 * 2 * 2 * 64 * 2
    assert routes["shared"]["kv_bytes"] == (256 + 3 * 64) * per_key
    assert routes["grouped"]["kv_bytes"] == 3 * (256 + 64) * per_key
