"""bench/paced_step_profile.py's summary of a py-spy raw profile: samples split by
phase and round, sorted into categories, scaled to milliseconds a step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "paced_step_profile.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("paced_step_profile", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stack(*frames: str) -> str:
    return ";".join(frames)


MAIN = ("<module> (paced_step_profile.py:1)", "run (paced_step_profile.py:2)")
MEASURED = MAIN + ("run.<locals>.one_round (paced_step_profile.py:3)",)
WARM_UP = MAIN + ("run.<locals>.warm_up (paced_step_profile.py:4)",
                  "run.<locals>.one_round (paced_step_profile.py:3)")
DECODE = "run.<locals>.decode_only_steps (paced_step_profile.py:5)"
PACED = "run.<locals>.paced_steps (paced_step_profile.py:6)"
STEP = "GenerationBatch._step (mlx_lm/generate.py:1434)"
FORWARD = "MixedStepModel._forward (runtime/mixed_step.py:439)"
EVAL = "mlx::core::async_eval (libmlx.so)"


def write_profile(tmp_path: Path) -> tuple[Path, Path]:
    lines = [
        # measured decode-only steps: 10 samples building CUDA graphs, 2 waiting
        stack(*MEASURED, DECODE, STEP, EVAL, "mlx::core::cu::CommandEncoder::commit (libmlx.so)")
        + " 10",
        stack(*MEASURED, DECODE, STEP, "cuEventSynchronize (libcuda.so)") + " 2",
        # measured paced steps: 30 in cuBLASLt, 6 in Python itself
        stack(*MEASURED, PACED, FORWARD, EVAL, "cublasLtMatmul (libcublasLt.so)") + " 30",
        stack(*MEASURED, PACED, FORWARD) + " 6",
        # the warm-up round: left out unless asked for
        stack(*WARM_UP, PACED, FORWARD, EVAL, "nvrtcCompileProgram (libnvrtc.so)") + " 50",
        # outside both phases (loading): never counted
        stack(*MAIN, "load (runtime/engine/loading.py:9)", "malloc (libc.so.6)") + " 99",
    ]
    raw = tmp_path / "profile.raw"
    raw.write_text("\n".join(lines) + "\n")
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"rate": 100.0, "result": {
        "decode_only": [[5.0, 1.0]] * 4, "paced": [[12.0, 2.0, 64]] * 6}}))
    return raw, steps


def rows(text: str, phase: str) -> dict[str, float]:
    """The category lines of one phase's block: {category: value}."""
    block = text.split(phase, 1)[1].split("by innermost Python frame", 1)[0]
    out = {}
    for line in filter(str.strip, block.splitlines()[1:]):
        value, _, name = line.strip().partition("  ")
        out[name.strip()] = float(value)
    return out


def test_measured_round_as_ms_a_step(tmp_path):
    bench = load_bench()
    raw, steps = write_profile(tmp_path)
    text = bench.summarize(str(raw), str(steps), top=5)
    decode, paced = rows(text, "decode_only_steps ("), rows(text, "paced_steps (")
    # 100 samples a second: a sample is 10 ms; 4 decode steps, 6 paced ones.
    assert decode == {"CUDA graphs": 25.0, "wait for the device": 5.0}
    assert paced == {"cuBLASLt": 50.0, "Python": 10.0}
    assert "nvrtc" not in text and "malloc" not in text


def test_warm_up_round_as_shares(tmp_path):
    bench = load_bench()
    raw, steps = write_profile(tmp_path)
    text = bench.summarize(str(raw), str(steps), top=5, warm_up=True)
    assert "% of the phase's samples" in text
    assert rows(text, "paced_steps (") == {"cuDNN / NVRTC": 100.0}
    assert rows(text, "decode_only_steps (") == {}


def test_report_groups_paced_steps_by_chunk():
    bench = load_bench()
    text = bench.report({"decode_only": [[5.0, 1.0], [7.0, 1.0]],
                         "paced": [[12.0, 2.0, 64], [14.0, 2.0, 64], [30.0, 3.0, 256]]})
    assert "chunk    64:    2 steps, p50   13.0 ms" in text
    assert "chunk   256:    1 steps, p50   30.0 ms" in text
