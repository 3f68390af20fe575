"""Prefill not done twice: a retry after a client gave up, and a first turn after a restart.

Two scenes, each beside its cold baseline, measured as a user sees them
(streaming chat requests to a server started here, time to the first data
chunk). A prompt is an agent's first request: a system prompt of
``--system-tokens`` and a user turn of ``--user-tokens``, new text each time.

``retry``: a client sends the prompt, reads the server's ``: keepalive
DONE/TOTAL`` comments and closes the connection once ``--leave-at`` of the
prompt is done, then sends the same request again; the retry's TTFT and
``cached_tokens``. Run on a server with the defaults (what it computed
before the client left is kept: ``--aborted-prefill-min-tokens``) and on one
with ``--aborted-prefill-min-tokens 0`` (it is dropped), alternated.

``restart``: a session's first request on a server started with
``--prompt-cache-dir``; the server is stopped and started again on the same
folder, and another session's first request (the same system prompt, its own
user turn) is measured; then, after another restart, the next turn of the
conversation that opened the scene (its first request, the reply and a new
user turn). Against the
same after restarts without the folder (where the next turn is computed
whole, and is slower than the cold first turn it is compared with).

The cold TTFT of the same shape on the same server is measured in every
repetition, so each ratio is taken within one server's run.

  python bench/resume_prefill.py --model DIR [--system-tokens 3000] [--reps 3]

Results: ``bench/results/<--out>/resume-<model>.json`` (or ``--json-out``) and a
table on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import httpx  # noqa: E402
from loadgen import PromptBuilder, ServerProcess, setup_logging  # noqa: E402
from side_by_side import free_port, server_argv  # noqa: E402

PROGRESS = re.compile(rb": keepalive (\d+)/(\d+)")


def prompt(builder: PromptBuilder, ns: argparse.Namespace, tag: str, system_seed: str):
    rng = random.Random(system_seed)
    system = builder.words(ns.system_tokens, rng, lead=f"You are agent {system_seed}.")
    user = builder.words(ns.user_tokens, random.Random(tag), lead=f"Task {tag}:")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def body(messages) -> dict[str, Any]:
    return {"model": "default_model", "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}


def timed(url: str, messages) -> dict[str, Any]:
    """TTFT (s) of a streamed request, the cached tokens it reports, and its reply."""
    began = time.perf_counter()
    ttft, cached, reply = None, None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body(messages),
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - began
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                reply.append(choice["delta"].get("content") or "")
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"ttft_s": ttft, "cached_tokens": cached, "reply": "".join(reply)}


def leave_midway(url: str, messages, leave_at: float) -> int:
    """Stream ``messages``, close the connection once ``leave_at`` of the prompt is done;
    the prompt tokens done by then."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body(messages),
                      timeout=600) as r:
        for raw in r.iter_raw():
            notes = PROGRESS.findall(raw)
            if notes:
                done, total = (int(x) for x in notes[-1])
                if done >= leave_at * total:
                    return done
            if b"data: {" in raw:
                return -1  # the prompt was done before we could leave
    return -1


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = httpx.get(f"{url}/health", timeout=5).json()
        if h.get("active_sequences") == 0 and h.get("requests_in_flight") == 0:
            return
        time.sleep(0.05)
    raise TimeoutError("the server did not go idle")


def started(ns, port: int, extra: list[str], log: Path) -> ServerProcess:
    argv = server_argv("ours", ns.model, port) + extra
    server = ServerProcess("ours", argv, f"http://127.0.0.1:{port}", log)
    server.start(cwd=REPO)
    server.wait_healthy()
    return server


def retry_scene(ns, builder, rep: int, kept: bool, log_dir: Path) -> dict[str, Any]:
    extra = [] if kept else ["--aborted-prefill-min-tokens", "0"]
    server = started(ns, free_port(), extra, log_dir / f"retry-{rep}-{kept}.log")
    try:
        timed(server.url, prompt(builder, ns, f"warm-{rep}-{kept}", f"warm-{rep}-{kept}"))
        cold = timed(server.url, prompt(builder, ns, f"cold-{rep}-{kept}", f"cold-{rep}-{kept}"))
        messages = prompt(builder, ns, f"retry-{rep}-{kept}", f"retry-{rep}-{kept}")
        done = leave_midway(server.url, messages, ns.leave_at)
        wait_idle(server.url)
        retry = timed(server.url, messages)
    finally:
        server.stop()
    return {"kept": kept, "cold": cold, "left_at_tokens": done, "retry": retry}


def restart_scene(ns, builder, rep: int, folder: bool, log_dir: Path) -> dict[str, Any]:
    """One agent's first turn on one server; after a restart, another agent's first
    turn (the same system prompt); after another restart, the first agent's second
    turn (its conversation so far, then a new user turn)."""
    disk = Path(tempfile.mkdtemp(prefix="resume-kv-"))
    extra = ["--prompt-cache-dir", str(disk)] if folder else []
    system_seed = f"restart-{rep}-{folder}"
    first_turn = prompt(builder, ns, f"{system_seed}-s1", system_seed)

    def server_life(run: str, requests: list) -> list[dict[str, Any]]:
        """A server started, warmed up with a request of its own, sent ``requests``
        (each a function of the results so far giving messages), stopped."""
        server = started(ns, free_port(), extra, log_dir / f"restart-{rep}-{folder}-{run}.log")
        try:
            timed(server.url, prompt(builder, ns, f"warm-{run}-{system_seed}", f"warm-{run}"))
            results: list[dict[str, Any]] = []
            for messages_of in requests:
                results.append(timed(server.url, messages_of(results)))
            return results
        finally:
            server.stop()

    def second_turn(_results) -> list:
        user = builder.words(ns.user_tokens, random.Random(f"{system_seed}-s1-t2"), lead="Next:")
        return [*first_turn, {"role": "assistant", "content": cold["reply"]},
                {"role": "user", "content": user}]

    try:
        (cold,) = server_life("a", [lambda _: first_turn])
        (after,) = server_life("b", [lambda _: prompt(builder, ns, f"{system_seed}-s2", system_seed)])
        (resumed,) = server_life("c", [second_turn])
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return {"folder": folder, "cold": cold, "after_restart": after, "second_turn": resumed}


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--system-tokens", type=int, default=3000)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--leave-at", type=float, default=0.5, help="share of the prompt done")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenes", default="retry,restart")
    p.add_argument("--out", default="cpu-resume", help="a folder under bench/results")
    p.add_argument("--json-out", type=Path, help="the results file (default: in --out)")
    ns = p.parse_args(argv)
    setup_logging()
    builder = PromptBuilder(ns.model)
    out_dir = BENCH / "results" / ns.out
    log_dir = BENCH / "results" / "logs"  # server logs, not kept in git
    scenes = ns.scenes.split(",")
    runs: list[dict[str, Any]] = []
    for rep in range(ns.reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        for on in order:
            if "retry" in scenes:
                runs.append({"scene": "retry", "rep": rep,
                             **retry_scene(ns, builder, rep, on, log_dir)})
            if "restart" in scenes:
                runs.append({"scene": "restart", "rep": rep,
                             **restart_scene(ns, builder, rep, on, log_dir)})
    rows = []
    for scene, flag, measured in (("retry", "kept", "retry"), ("restart", "folder", "after_restart"),
                                  ("restart", "folder", "second_turn")):
        for on in (True, False):
            mine = [r for r in runs if r["scene"] == scene and r[flag] == on]
            if not mine:
                continue
            cold = median(r["cold"]["ttft_s"] for r in mine)
            then = median(r[measured]["ttft_s"] for r in mine)
            rows.append({
                "scene": scene if measured != "second_turn" else "restart, a session's next turn",
                "on": on, "runs": len(mine),
                "cold_ttft_ms": round(1000 * cold, 1), "ttft_ms": round(1000 * then, 1),
                "ratio": round(then / cold, 3),
                "cached_tokens": median(r[measured]["cached_tokens"] for r in mine),
            })
    result = {"model": ns.model, "system_tokens": ns.system_tokens,
              "user_tokens": ns.user_tokens, "leave_at": ns.leave_at, "summary": rows,
              "runs": runs}
    path = ns.json_out or out_dir / f"resume-{Path(ns.model).name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print("| scene | feature | runs | cold TTFT p50 (ms) | TTFT p50 (ms) | ratio | cached |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scene']} | {'on' if r['on'] else 'off'} | {r['runs']} | "
              f"{r['cold_ttft_ms']} | {r['ttft_ms']} | {r['ratio']} | {r['cached_tokens']} |")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
