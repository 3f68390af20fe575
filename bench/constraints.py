"""What sampling and structured outputs cost a server: one server, several workloads.

Starts ``python -m api.cli`` (from ``--source``: this checkout, or another
source tree, e.g. an older commit extracted with ``git archive``, for a
before/after pair) on one model and runs ``bench/loadgen.py``'s closed loop at each
level for each mode, alternating the modes per round so that a drift of the
machine hits them alike:

* ``greedy``: temperature 0;
* ``sampled``: temperature 0.7, top_p 0.9, the same for every request;
* ``mixed``: temperature and top_p varied over four sets (``--mixed-sampling``);
* ``distinct``: each request its own temperature, top_p and top_k, drawn at
  random (``--distinct-sampling``: no two requests alike, as arbitrary clients);
* ``constrained``: greedy, every request with ``response_format`` json_schema
  (``loadgen.BENCH_SCHEMA``: never finished within max_tokens, so every token
  is masked and a request is as long as a free one);
* ``half-constrained``: the same on half of the requests (free and constrained
  rows in one batch); ``quarter-constrained``: on a quarter of them;
* ``constrained-sampled``: ``constrained`` with temperature 0.7, top_p 0.9.

Every chat request sends ``enable_thinking: false`` (``--thinking off``, the
default): a constrained request must (the constraint would otherwise let the
model open a thinking block), and a free one then has a prompt of the same
shape, so that the modes differ by the response format alone.

Prints one line per (mode, level) and run, with the engine's median decode
step (time inside the batch generator's ``next`` on steps that prefilled
nothing) and its host-speed probe (``runtime.engine.host_speed``: on the
H200's host the same Python loop takes 16 or 30 us in stretches, so compare
runs at like probes), then a table of tokens/s with each mode's ratio to
greedy; writes the summaries and the runs to ``--json-out``. A server that does
not know ``response_format`` (an older tree) ignores it: run only the
sampling modes there. ``python bench/constraints.py --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import (  # noqa: E402  (a script beside loadgen.py)
    PromptBuilder,
    ServerProcess,
    Workload,
    format_summary,
    parse_levels,
    requests_for,
    run_level,
    setup_logging,
    summarize,
    warm_up,
)

REPO = Path(__file__).resolve().parents[1]
PROBE_ENV = "MLX_TRIO_ENGINE_PROBE"  # runtime.engine.host_speed: the engine's per-step log
SAMPLED = {"temperature": 0.7, "top_p": 0.9}
MODES = {
    "greedy": {},
    "sampled": SAMPLED,
    "mixed": {"temperature": 0.7, "top_p": 0.9, "mixed_sampling": True},
    "distinct": {"temperature": 0.7, "distinct_sampling": True},
    "constrained": {"constrained": "json_schema"},
    "half-constrained": {"constrained": "json_schema", "constrained_fraction": 0.5},
    "quarter-constrained": {"constrained": "json_schema", "constrained_fraction": 0.25},
    "constrained-sampled": {"constrained": "json_schema", **SAMPLED},
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_steps(prefix: Path, began: float, ended: float) -> dict:
    """The engine's median decode step (ms in ``next``) and host probe (us) in a run."""
    decode_ms, probes = [], []
    for path in prefix.parent.glob(prefix.name + "*"):
        steps = path.name.startswith(prefix.name + "-steps.")
        for line in path.read_text().splitlines():
            fields = line.split()
            if steps and fields[0] == "S" and began <= float(fields[1]) <= ended:
                if fields[5] == "0" and int(fields[3]) > 0:  # prefilled nothing, decoded
                    decode_ms.append(float(fields[7]))
            elif not steps and len(fields) == 2 and began <= float(fields[0]) <= ended:
                probes.append(float(fields[1]))
    return {
        "decode_step_ms_p50": round(statistics.median(decode_ms), 2) if decode_ms else None,
        "decode_steps": len(decode_ms),
        "probe_us_p50": round(statistics.median(probes), 1) if probes else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    p.add_argument("--source", default=str(REPO), help="source tree the server runs from")
    p.add_argument("--modes", default="greedy,constrained,half-constrained",
                   help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--levels", type=parse_levels, default=[1, 32])
    p.add_argument("--requests", type=int, default=None, help="per run (default max(8, 2c))")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=110)
    p.add_argument("--thinking", choices=("off", "template"), default="off",
                   help="off: every chat request sends enable_thinking false, as the constrained "
                   "ones must, so that the modes' prompts have one shape (a thinking-off prompt "
                   "ends in an empty think block, which models whose cache cannot be trimmed "
                   "prefill in one more step); template: the free requests keep the "
                   "template's default")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--server-args", default="--decode-concurrency 64",
                   help="more flags for the server")
    p.add_argument("--json-out", default=None)
    p.add_argument("--probe-dir", default=None,
                   help="keep the engine's step log here (default: a temporary folder)")
    ns = p.parse_args(argv)
    setup_logging()
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}")

    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-model-")) / "tiny"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv_server = [sys.executable, "-m", "api.cli", "--model", model, "--port", str(port),
                   *ns.server_args.split()]
    log_path = REPO / "bench" / "results" / "logs" / f"constraints-{time.strftime('%H%M%S')}.log"
    server = ServerProcess("server", argv_server, url, log_path)
    probe_dir = Path(ns.probe_dir or tempfile.mkdtemp(prefix="constraints-probe-"))
    probe_dir.mkdir(parents=True, exist_ok=True)
    probe_prefix = probe_dir / "probe"
    # The source tree first, then whatever the caller's path already holds (the
    # device machine's packages live on PYTHONPATH).
    inherited = os.environ.get("PYTHONPATH")
    server.start(cwd=ns.source, env={
        "PYTHONPATH": os.pathsep.join(filter(None, [ns.source, inherited])),
        PROBE_ENV: str(probe_prefix),
    })
    builder = PromptBuilder(model)
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        server.wait_healthy()
        base = Workload(prompt_tokens=ns.prompt_tokens, max_tokens=ns.max_tokens,
                        enable_thinking=False if ns.thinking == "off" else None)
        workloads = {m: dataclasses.replace(base, **MODES[m]) for m in modes}
        for w in workloads.values():
            warm_up(url, w, builder)
        first_index = 0
        for round_ in range(ns.rounds):
            for level in ns.levels:
                for mode in modes if round_ % 2 == 0 else modes[::-1]:
                    n = requests_for(ns, level)
                    began = time.time()
                    run = run_level(url, workloads[mode], level, n, builder, server.pid,
                                    first_index)
                    ended = time.time()
                    time.sleep(0.7)  # the engine writes its step log every half second
                    run["engine"] = engine_steps(probe_prefix, began, ended)
                    first_index += n
                    runs.setdefault((mode, level), []).append(run)
                    e = run["engine"]
                    print(f"round {round_ + 1} {mode:<20} " + format_summary(level, summarize([run]))
                          + f" decode step {e['decode_step_ms_p50']} ms"
                          f" probe {e['probe_us_p50']} us", flush=True)
    finally:
        server.stop()

    summaries = {key: summarize(r) for key, r in runs.items()}
    print(f"\ntokens/s (pooled over {ns.rounds} rounds); in brackets: / greedy; "
          "server CPU ms per token")
    print("| mode | " + " | ".join(f"c={level}" for level in ns.levels) + " |")
    print("|---|" + "---|" * len(ns.levels))
    for mode in modes:
        cells = []
        for level in ns.levels:
            s = summaries[(mode, level)]
            greedy = summaries.get(("greedy", level))
            ratio = f" ({s['tok_s'] / greedy['tok_s']:.2f})" if greedy and mode != "greedy" else ""
            errors = f" errors {s['errors']}" if s["errors"] else ""
            cpu = s["cpu_ms_per_token"]
            cells.append(f"{s['tok_s']:.0f}{ratio}; {cpu:.2f} ms{errors}" if cpu is not None
                         else f"{s['tok_s']:.0f}{ratio}{errors}")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({
            "model": model, "source": ns.source, "server": argv_server, "rounds": ns.rounds,
            "workload": dataclasses.asdict(base),
            "summaries": {f"{m}@{level}": s for (m, level), s in summaries.items()},
            "runs": {f"{m}@{level}": [dict(summarize([r]), engine=r["engine"]) for r in rs]
                     for (m, level), rs in runs.items()},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
