"""bench/prompt_wave.py on the tiny model: waves of requests over one cached system
prompt, the step that prefills their user turns taken apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import prompt_wave  # noqa: E402


def test_each_wave_prefills_its_rows_after_the_cached_prefix_in_parts(tmp_path, capsys):
    out = tmp_path / "wave.json"
    assert prompt_wave.main(["--prefix", "600", "--rows", "3", "--suffix", "20-60",
                             "--waves", "2", "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    for wave in (0, 1):
        steps = [r for r in data["records"] if r["wave"] == wave]
        longest = max(steps, key=lambda r: r["wall_ms"])
        assert longest["rows"] == 3
        # three copies of the cached prefix, one merge of the rows, their prefill, the
        # rows of different lengths aligned: each timed, inside the step's wall time
        assert all(longest[k] > 0 for k in prompt_wave.PARTS)
        inside = sum(longest[k] for k in ("merge", "prefill", "align"))
        assert inside < longest["wall_ms"]
    assert set(data["medians"]) == {"wall_ms", *prompt_wave.PARTS, "rest"}
    assert "longest step" in capsys.readouterr().out
