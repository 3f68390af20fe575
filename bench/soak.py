"""Memory soak and abort latency, against one server.

    python bench/soak.py [--model DIR] [--requests 10000] [--concurrency 16] [--every 1000]
                         [--aborts 50] [--out bench/results/soak.json]

1. **Soak**: ``--requests`` short chat requests (closed loop, ``--concurrency``
   clients; a third streaming, a sixth of the streams dropped after their first
   chunk, the rest plain JSON), with the server's RSS (``/proc``) sampled every
   ``--every`` requests. A per-request leak shows as RSS growing with the
   count; the figure is the slope over the second half (MiB per 1000 requests).
2. **Abort latency**: ``--aborts`` times, one long streaming request beside
   three others that keep the batch busy; after its third chunk the client
   closes the socket. Reports the time from the close until the engine's
   abort counter moves (``/metrics`` polled on a kept-alive connection), and
   the engine's own figures: how long the ``Abort`` waited in its inbox and
   how many steps finished meanwhile (at most one by design).

Starts ``python -m api.cli --model DIR`` itself (the tiny random model
when no ``--model``), prints a summary and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen import ServerProcess, proc_tree_stats, setup_logging  # noqa: E402

log = logging.getLogger("bench.soak")


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


async def _soak(url: str, total: int, concurrency: int, every: int, pid: int) -> list[dict]:
    import trio

    samples: list[dict] = []
    done = 0
    errors = 0
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal errors
            body = {"messages": [{"role": "user", "content": f"soak {i}: hello there {i % 97}"}],
                    "max_tokens": 8}
            try:
                if i % 3 == 0:
                    body["stream"] = True
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            if i % 6 == 0:
                                break  # a client that leaves after its first chunk
                else:
                    r = await client.post("/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        errors += 1
            except httpx.HTTPError:
                errors += 1

        async def worker() -> None:
            nonlocal done, next_index
            while next_index < total:
                i = next_index
                next_index += 1
                await one(i)
                done += 1
                if done % every == 0:
                    stats = proc_tree_stats(pid) or {}
                    samples.append({"requests": done, "rss_mb": round(stats.get("rss_mb", 0), 1),
                                    "errors": errors, "t": round(time.perf_counter(), 1)})
                    log.info("%d requests: RSS %.1f MiB, errors %d", done, samples[-1]["rss_mb"],
                             errors)

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return samples


def soak(url: str, total: int, concurrency: int, every: int, pid: int) -> dict:
    import trio

    start = proc_tree_stats(pid) or {}
    t0 = time.perf_counter()
    samples = trio.run(_soak, url, total, concurrency, every, pid)
    wall = time.perf_counter() - t0
    half = [s for s in samples if s["requests"] > total // 2]
    slope = None
    if len(half) >= 2:
        xs = [s["requests"] / 1000 for s in half]
        ys = [s["rss_mb"] for s in half]
        slope = statistics.linear_regression(xs, ys).slope
    return {
        "requests": total,
        "concurrency": concurrency,
        "wall_s": round(wall, 1),
        "rss_start_mb": round(start.get("rss_mb", 0), 1),
        "samples": samples,
        "rss_slope_mb_per_1000_second_half": None if slope is None else round(slope, 3),
        "errors": samples[-1]["errors"] if samples else None,
    }


def _stream_then_drop(url: str, prompt: str, chunks: int, closed_at: list) -> None:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "max_tokens": 100000, "stream": True}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    sock = socket.create_connection((host, int(port)))
    sock.sendall(request)
    received = b""
    while received.count(b"data: {") < chunks:
        data = sock.recv(65536)
        if not data:
            break
        received += data
    closed_at.append(time.perf_counter())
    sock.close()


def abort_latency(url: str, n: int) -> dict:
    """From a client's close to its sequence leaving the batch, while 3 others decode.

    Two figures: the whole path (client close -> the server notices the closed
    socket -> abort -> the engine removes the sequence), timed from the
    client until ``mlx_trio_engine_aborts_total`` moves; and the engine's part
    (the ``Abort`` posted -> applied), in ms and in engine steps finished in
    between, from the engine's own counters.
    """
    keep_busy = 3
    stop = threading.Event()

    def background(i: int) -> None:
        while not stop.is_set():
            try:
                httpx.post(url + "/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": f"busy {i}"}], "max_tokens": 64})
            except httpx.HTTPError:
                time.sleep(0.1)

    threads = [threading.Thread(target=background, args=(i,), daemon=True)
               for i in range(keep_busy)]
    for t in threads:
        t.start()
    close_to_removed_ms = []
    start = metrics(url)
    try:
        with httpx.Client(base_url=url, timeout=10) as probe:
            def aborts() -> float:
                for line in probe.get("/metrics").text.splitlines():
                    if line.startswith("mlx_trio_engine_aborts_total "):
                        return float(line.split()[1])
                return 0.0

            for k in range(n):
                before = aborts()
                closed: list[float] = []
                _stream_then_drop(url, f"abort {k}: a long story", 3, closed)
                deadline = time.perf_counter() + 10
                while aborts() <= before and time.perf_counter() < deadline:
                    pass
                close_to_removed_ms.append((time.perf_counter() - closed[0]) * 1000)
                time.sleep(0.05)
    finally:
        stop.set()
    end = metrics(url)
    count = end["mlx_trio_engine_aborts_total"] - start["mlx_trio_engine_aborts_total"]
    wait_total = (end["mlx_trio_engine_abort_wait_ms_total"]
                  - start["mlx_trio_engine_abort_wait_ms_total"])
    return {
        "aborts": n,
        "close_to_removed_ms_p50": round(statistics.median(close_to_removed_ms), 2),
        "close_to_removed_ms_max": round(max(close_to_removed_ms), 2),
        "engine_abort_wait_ms_mean": round(wait_total / count, 3) if count else None,
        "engine_abort_wait_ms_max": end["mlx_trio_engine_abort_wait_ms_max"],
        "engine_abort_wait_steps_max": end["mlx_trio_engine_abort_wait_steps_max"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=8461)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--aborts", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    ns = p.parse_args(argv)
    setup_logging()
    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    url = f"http://127.0.0.1:{ns.port}"
    server = ServerProcess("server", [sys.executable, "-m", "api.cli", "--model", model,
                                      "--port", str(ns.port), "--log-level", "WARNING"],
                           url, ns.out.parent / "logs" / (ns.out.stem + ".log"))
    server.start(cwd=str(Path(__file__).resolve().parents[1]))
    try:
        server.wait_healthy()
        result = {"model": model}
        if ns.aborts:
            result["abort"] = abort_latency(url, ns.aborts)
            log.info("abort: %s", result["abort"])
        if ns.requests:
            result["soak"] = soak(url, ns.requests, ns.concurrency, ns.every, server.pid)
    finally:
        server.stop()
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    if "soak" in result:
        s = result["soak"]
        print(f"soak: {s['requests']} requests in {s['wall_s']} s, RSS "
              + " ".join(f"{x['requests']}:{x['rss_mb']}" for x in s["samples"])
              + f" MiB; slope (2nd half) {s['rss_slope_mb_per_1000_second_half']} MiB/1000; "
              f"errors {s['errors']}")
    if "abort" in result:
        print("abort:", result["abort"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
