"""Side by side: mlx_lm.server, mlx-trio-server and the engine ceiling, in one run.

Owns the one-command benchmark. It builds (or takes) a model, starts
``python -m mlx_lm server`` ("ref") and ``python -m api.cli`` ("ours") on it
with the same flags (``--decode-concurrency 64``, everything else at its
default), waits for both ``/health``, warms each up, and then for every
concurrency level runs ``--rounds`` rounds of engine / ref / ours, swapping the
order of ref and ours every round (A/B, B/A, ...) so that drift on a noisy
machine hits both alike. The engine runs in a fresh subprocess
(``engine_ceiling.py``) per level and round, while both servers sit idle.

Every run at a level sends the same requests (the same prompt indices) to each
system, and each level/round gets indices no earlier run used, so no server's
prompt cache can skip a prefill it did not earn.

Prints a table (tokens/s, ratios, TTFT p50, inter-chunk p99, CPU ms per output
token) and writes ``bench/results/<timestamp>.json`` and ``.png`` (tokens/s and
TTFT p50 against concurrency). Server logs go to ``bench/results/logs/``.

    /tmp/venv/bin/python bench/side_by_side.py --quick
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from loadgen import (  # noqa: E402
    PromptBuilder,
    ServerProcess,
    Workload,
    add_workload_args,
    default_requests,
    proc_tree_stats,
    progress_reporter,
    requests_for,
    run_level,
    setup_logging,
    summarize,
    warm_up,
    workload_from_args,
)

log = logging.getLogger("bench.side_by_side")

SYSTEMS = ("engine", "ref", "ours")
# Optional (``--only ...,ours-thread``): ours with the engine on a thread of the
# server process instead of in its own process (``--engine-mode thread``).
EXTRA_SYSTEMS = ("ours-thread",)
SERVERS = ("ref", "ours", "ours-thread")
LABELS = {
    "engine": "engine",
    "ref": "mlx_lm.server",
    "ours": "mlx-trio-server",
    "ours-thread": "mlx-trio-server (engine thread)",
}
SERVER_FLAGS = ["--decode-concurrency", "64"]


# Prompts of the warm-up pass: indices no measured run uses.
WARM_UP_FIRST_INDEX = 1_000_000


progress = progress_reporter(log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(system: str, model: str, port: int) -> list[str]:
    if system == "ref":
        head = [sys.executable, "-m", "mlx_lm", "server"]
    else:
        head = [sys.executable, "-m", "api.cli"]
    if system == "ours-thread":
        head = [*head, "--engine-mode", "thread"]
    return [*head, "--model", model, "--port", str(port), *SERVER_FLAGS]


def idle_cpu_pct(pid: int, seconds: float = 2.0) -> float | None:
    """The server's CPU use while nobody talks to it (busy polling shows here)."""
    before = proc_tree_stats(pid)
    time.sleep(seconds)
    after = proc_tree_stats(pid)
    if before is None or after is None:
        return None
    return round(100 * (after["cpu_s"] - before["cpu_s"]) / seconds, 1)


def run_engine(
    model: str, w: Workload, level: int, requests: int, first_index: int
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = Path(tmp.name)
    try:
        argv = [
            sys.executable,
            str(BENCH / "engine_ceiling.py"),
            "--model",
            model,
            "--levels",
            str(level),
            "--requests",
            str(requests),
            "--first-index",
            str(first_index),
            "--prompt-tokens",
            str(w.prompt_tokens),
            "--max-tokens",
            str(w.max_tokens),
            "--endpoint",
            w.endpoint,
            "--system-prompt-tokens",
            str(w.system_prompt_tokens),
            "--seed",
            str(w.seed),
            "--temperature",
            str(w.temperature),
            "--top-p",
            str(w.top_p),
            *(["--mixed-sampling"] if w.mixed_sampling else []),
            "--json-out",
            str(out),
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"engine_ceiling failed:\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())[str(level)]
    finally:
        out.unlink(missing_ok=True)


def _fmt(v: Any, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def render_table(levels: list[int], pooled: dict[int, dict[str, dict]]) -> str:
    def get(level: int, system: str, key: str):
        return pooled[level].get(system, {}).get(key)

    def trio_(level: int, key: str, spec: str) -> str:
        return "/".join(_fmt(get(level, s, key), spec) for s in SYSTEMS)

    header = (
        f"{'conc':>4} | {'engine':>7} {'mlx_lm':>7} {'ours':>7} tok/s | "
        f"{'ours/ref':>8} {'ours/eng':>8} | {'TTFT p50 ms e/r/o':>19} | "
        f"{'ITL p99 ms e/r/o':>17} | {'CPU ms/tok e/r/o':>18} | errors r/o"
    )
    lines = [header, "-" * len(header)]
    for level in levels:
        tok = {s: get(level, s, "tok_s") for s in SYSTEMS}
        errors = "/".join(
            str(sum(pooled[level].get(s, {}).get("errors", {}).values()))
            if s in pooled[level]
            else "-"
            for s in ("ref", "ours")
        )
        lines.append(
            f"{level:>4} | {_fmt(tok['engine']):>7} {_fmt(tok['ref']):>7} "
            f"{_fmt(tok['ours']):>7}       | "
            f"{_ratio(tok['ours'], tok['ref']):>8} {_ratio(tok['ours'], tok['engine']):>8} | "
            f"{trio_(level, 'ttft_p50_ms', '.1f'):>19} | "
            f"{trio_(level, 'itl_p99_ms', '.1f'):>17} | "
            f"{trio_(level, 'cpu_ms_per_token', '.2f'):>18} | {errors}"
        )
    if any("ours-thread" in pooled[level] for level in levels):
        lines += ["", engine_mode_table(levels, pooled)]
    lines += ["", steps_table(levels, pooled)]
    return "\n".join(lines)


def steps_table(levels: list[int], pooled: dict[int, dict[str, dict]]) -> str:
    """Engine steps for the same work, and how busy the engine was (ours: from /metrics)."""
    systems = [s for s in ("engine", "ours", "ours-thread") if any(s in pooled[lv] for lv in levels)]
    names = "/".join({"engine": "e", "ours": "o", "ours-thread": "t"}[s] for s in systems)
    header = (
        f"{'conc':>4} | {'steps ' + names:>20} | {'prefill steps ' + names:>22} | "
        f"{'ms/step ' + names:>20} | {'engine busy % ' + names:>22}"
    )
    lines = [header, "-" * len(header)]
    for level in levels:
        cells = {k: [] for k in ("steps", "prefill", "ms", "busy")}
        for system in systems:
            r = pooled[level].get(system, {})
            steps = r.get("engine_steps")
            busy = r.get("engine_busy_pct")
            cells["steps"].append(_fmt(steps))
            cells["prefill"].append(_fmt(r.get("engine_prefill_steps")))
            ms = busy * r["wall_s"] * 10 / steps if steps and busy is not None else None
            cells["ms"].append(_fmt(ms, ".1f"))
            cells["busy"].append(_fmt(busy))
        lines.append(
            f"{level:>4} | {'/'.join(cells['steps']):>20} | {'/'.join(cells['prefill']):>22} | "
            f"{'/'.join(cells['ms']):>20} | {'/'.join(cells['busy']):>22}"
        )
    return "\n".join(lines)


def engine_mode_table(levels: list[int], pooled: dict[int, dict[str, dict]]) -> str:
    """Ours with the engine in its own process vs on a thread of the server process."""
    header = (
        f"{'conc':>4} | {'process':>7} {'thread':>7} tok/s | {'proc/thr':>8} | "
        f"{'TTFT p50 ms p/t':>15} | {'CPU ms/tok p/t':>14}"
    )
    lines = [header, "-" * len(header)]
    for level in levels:
        mine = pooled[level].get("ours", {})
        thread = pooled[level].get("ours-thread", {})

        def pair(key: str, spec: str, mine=mine, thread=thread) -> str:
            return f"{_fmt(mine.get(key), spec)}/{_fmt(thread.get(key), spec)}"

        lines.append(
            f"{level:>4} | {_fmt(mine.get('tok_s')):>7} {_fmt(thread.get('tok_s')):>7}       | "
            f"{_ratio(mine.get('tok_s'), thread.get('tok_s')):>8} | "
            f"{pair('ttft_p50_ms', '.1f'):>15} | {pair('cpu_ms_per_token', '.2f'):>14}"
        )
    return "\n".join(lines)


def plot(levels: list[int], pooled: dict[int, dict[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tok, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in (*SYSTEMS, *EXTRA_SYSTEMS):
        xs = [lv for lv in levels if pooled[lv].get(system, {}).get("tok_s")]
        if not xs:
            continue
        ax_tok.plot(xs, [pooled[lv][system]["tok_s"] for lv in xs], "o-", label=LABELS[system])
        ys = [(lv, pooled[lv][system].get("ttft_p50_ms")) for lv in xs]
        ys = [(lv, y) for lv, y in ys if y is not None]
        if ys:
            ax_ttft.plot(*zip(*ys, strict=True), "o-", label=LABELS[system])
    for ax, ylabel in ((ax_tok, "output tokens/s"), (ax_ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_ttft.set_yscale("log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("mlx", "mlx-lm", "mlx-trio-server", "httpx", "trio", "hypercorn"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="mlx_lm.server vs mlx-trio-server vs the engine ceiling, one run."
    )
    p.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    p.add_argument("--medium", action="store_true", help="build hidden 256 / 4 layers instead")
    p.add_argument(
        "--only",
        default=None,
        help="comma list of systems to run: engine, ref (mlx_lm.server), ours, "
        "ours-thread (ours with --engine-mode thread; not run by default)",
    )
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per level")
    p.add_argument("--quick", action="store_true", help="smoke run: levels 1,4, 8 requests")
    p.add_argument("--results-dir", default=str(BENCH / "results"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="print the table and write the plot of an earlier run's results JSON "
        "(e.g. one made on a machine without matplotlib), then exit",
    )
    p.add_argument(
        "--warm-up-pass",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the engine once per level, unmeasured, so that kernels compiled on "
        "first use (mlx-cuda's NVRTC cache in /tmp/mlx) are not charged to whichever "
        "system runs first",
    )
    add_workload_args(p)
    ns = p.parse_args(argv)
    if ns.quick:
        ns.levels = [1, 4]
        ns.requests = ns.requests or 8
    ns.systems = list(SYSTEMS)
    if ns.only:
        ns.systems = [s.strip() for s in ns.only.split(",") if s.strip()]
        unknown = set(ns.systems) - set(SYSTEMS) - set(EXTRA_SYSTEMS)
        if unknown:
            p.error(f"--only: unknown {sorted(unknown)}; choose from {SYSTEMS + EXTRA_SYSTEMS}")
    return ns


def run_title(meta: dict[str, Any]) -> str:
    """The table's and the plot's heading, from a run's ``meta``."""
    w = meta["workload"]
    return (
        f"{Path(str(meta['model'])).name} model, prompt ~{w['prompt_tokens']} tok, "
        f"{w['max_tokens']} new, {'stream' if w['stream'] else 'no stream'} {w['endpoint']}, "
        f"{meta.get('machine', {}).get('cpus')} CPUs, {meta['timestamp']}"
    )


def replot(results_json: Path, draw: bool = True) -> int:
    data = json.loads(results_json.read_text())
    meta = data["meta"]
    pooled = {int(lv): by for lv, by in data["pooled"].items()}
    levels = sorted(pooled)
    title = run_title(meta)
    sys.stdout.write(f"{title}\n{render_table(levels, pooled)}\n")
    if not draw:  # --no-plot: the table alone
        return 0
    out_png = results_json.with_suffix(".png")
    plot(levels, pooled, out_png, title)
    sys.stdout.write(f"wrote {out_png}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    setup_logging()
    if ns.replot:
        return replot(Path(ns.replot), draw=not ns.no_plot)
    w = workload_from_args(ns)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    results_dir = Path(ns.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)

    tmp_model = None
    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        tmp_model = tempfile.mkdtemp(prefix="bench-model-")
        shape = {"hidden_size": 256, "num_layers": 4} if ns.medium else {}
        progress(f"building the {'medium' if ns.medium else 'tiny'} model in {tmp_model}")
        model = str(build_tiny_model(tmp_model, **shape))
    builder = PromptBuilder(model)

    servers: dict[str, ServerProcess] = {}
    for system in SERVERS:
        if system in ns.systems:
            port = free_port()
            servers[system] = ServerProcess(
                LABELS[system],
                server_argv(system, model, port),
                f"http://127.0.0.1:{port}",
                results_dir / "logs" / f"{stamp}-{system}.log",
            )
    meta: dict[str, Any] = {
        "timestamp": stamp,
        "model": ns.model or ("medium" if ns.medium else "tiny"),
        "model_path": model,
        "workload": asdict(w),
        "levels": ns.levels,
        "rounds": ns.rounds,
        "systems": ns.systems,
        "commands": {s: srv.argv for s, srv in servers.items()},
        "engine": {"decode_concurrency": 64, "prompt_concurrency": 8, "sampler": "greedy"},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": versions(),
    }
    runs: dict[int, dict[str, list[dict]]] = {lv: {s: [] for s in ns.systems} for lv in ns.levels}
    try:
        for server in servers.values():
            server.start(cwd=REPO)  # ``python -m api.cli`` from the repository root
        for server in servers.values():
            took = server.wait_healthy()
            progress(f"{server.name} healthy after {took:.1f} s (pid {server.pid})")
            warm_up(server.url, w, builder)
        meta["idle_cpu_pct"] = {s: idle_cpu_pct(srv.pid) for s, srv in servers.items()}
        progress(f"idle CPU %: {meta['idle_cpu_pct']}")
        meta["warm_up_pass"] = ns.warm_up_pass
        if ns.warm_up_pass:
            for level in ns.levels:
                progress(f"warm-up pass (not measured): engine at level {level}")
                run_engine(model, w, level, default_requests(level), WARM_UP_FIRST_INDEX)

        first_index = 0
        flips = 0
        for level in ns.levels:
            n = requests_for(ns, level)
            for rnd in range(ns.rounds):
                order = ["engine", "ref", "ours", "ours-thread"]
                if flips % 2:
                    order = ["engine", "ours-thread", "ours", "ref"]
                flips += 1
                for system in (s for s in order if s in ns.systems):
                    progress(f"level {level} round {rnd + 1}/{ns.rounds}: {system}, {n} requests")
                    if system == "engine":
                        run = run_engine(model, w, level, n, first_index)
                    else:
                        srv = servers[system]
                        run = run_level(srv.url, w, level, n, builder, srv.pid, first_index)
                    run["order"] = order.index(system)
                    runs[level][system].append(run)
                    s = summarize([run])
                    progress(
                        f"  {system}: {s['tok_s']} tok/s, TTFT p50 {s['ttft_p50_ms']} ms, "
                        f"errors {s['errors'] or 0}"
                    )
                first_index += n
    finally:
        for server in servers.values():
            rc = server.stop()
            meta.setdefault("exit_codes", {})[server.name] = rc
        if tmp_model is not None:
            shutil.rmtree(tmp_model, ignore_errors=True)

    pooled = {lv: {s: summarize(rs) for s, rs in by.items() if rs} for lv, by in runs.items()}
    per_round = {
        lv: {s: [summarize([r]) for r in rs] for s, rs in by.items()} for lv, by in runs.items()
    }
    table = render_table(ns.levels, pooled)
    title = run_title(meta)
    sys.stdout.write(f"{title}\n{table}\n")
    out_json = results_dir / f"{stamp}.json"
    out_json.write_text(
        json.dumps({"meta": meta, "pooled": pooled, "per_round": per_round}, indent=2) + "\n"
    )
    sys.stdout.write(f"wrote {out_json}\n")
    if not ns.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            log.warning("no matplotlib: no plot (pip install matplotlib, or --no-plot)")
        else:
            out_png = results_dir / f"{stamp}.png"
            plot(ns.levels, pooled, out_png, title)
            sys.stdout.write(f"wrote {out_png}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
