"""One client: our server's inter-token latency against the bare engine's step, alternated.

The one-client target: our ITL p50 at or below the bare
``BatchGenerator``'s fast-mode step in every repetition. At batch 1 the step
time is bimodal for every driver (``bench/step_modes.py``), so a single run
of each cannot tell a server's overhead from a mode flip: this script
alternates, rep by rep, one greedy request through our running server
(streaming chat, the time between content chunks) and the same prompt through
a ``BatchGenerator`` in this process (the time between ``next()`` calls that
return a token), for ``--reps`` repetitions, and prints both p50s per rep.

  python bench/one_client.py --model M --reps 5 [--url http://127.0.0.1:8080]

Without ``--url`` it starts ``mlx-trio-server`` itself (engine process, the
defaults) on a free port and stops it at the end. ``--json-out`` keeps every
gap.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_modes import one_rep  # noqa: E402

from runtime.engine.host_speed import cpu_probe_us  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "--model", model, "--port", str(port)],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def server_rep(base: str, messages: list, max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    times, probes = [], []
    began = time.time()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                times.append(time.perf_counter())
                probes.append(cpu_probe_us())  # this (client) process's core, between chunks
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
    return {"chunks": len(times), "p50_ms": statistics.median(gaps) if gaps else None,
            "began": began, "ended": time.time(),
            "probe_us_p50": statistics.median(probes) if probes else None,
            "gaps_ms": [round(g, 3) for g in gaps]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--url", default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=136)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    import mlx.core as mx
    from loadgen import PromptBuilder, Workload
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator, make_stop_sequences

    proc = None
    base = ns.url
    if base is None:
        proc, base = start_server(ns.model)
    try:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            model, tokenizer = load(ns.model)
        stop = make_stop_sequences(tokenizer)
        builder = PromptBuilder(ns.model)
        w = Workload(prompt_tokens=ns.prompt_tokens, max_tokens=ns.max_tokens)
        gen = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=8, stream=stream)

        def ids(i: int) -> list[int]:
            return list(tokenizer.apply_chat_template(
                builder.messages(w, i), add_generation_prompt=True, tokenize=True))

        one_rep(gen, ids(9_999), 16, stop)  # warm-up, both
        server_rep(base, builder.messages(w, 9_999), 16)
        rows = []
        for rep in range(ns.reps):
            began = time.time()
            bare = one_rep(gen, ids(rep), ns.max_tokens, stop)
            bare.update(began=began, ended=time.time())
            ours = server_rep(base, builder.messages(w, rep), ns.max_tokens)
            rows.append({"rep": rep, "bare": bare, "ours": ours})
            # probe: a fixed pure-Python loop timed once per step / chunk (step_modes.cpu_probe_us)
            print(f"rep {rep}: bare step p50 {bare['p50_ms']:.2f} ms ({bare['tokens']} tokens, "
                  f"probe {bare['probe_us_p50']:.1f} us) | ours ITL p50 {ours['p50_ms']:.2f} ms "
                  f"({ours['chunks']} chunks, client probe {ours['probe_us_p50']:.1f} us)",
                  flush=True)
        if ns.json_out:
            Path(ns.json_out).write_text(json.dumps(rows))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
