"""A long prompt arrives while others stream: do the streams keep getting tokens?

Starts a server (ours, or ``mlx_lm.server`` with ``--systems mlx_lm``), opens
``--streams`` streaming requests with short prompts and many tokens to
generate, waits until all of them decode, then sends one prompt of
``--long-tokens`` tokens (streamed, so it also counts the keep-alive comments
it gets while it waits), and ``--probe-after-s`` later one short request (is
it held behind the whole long prefill?). Reports, per system:

* the streams' time between tokens: median before the long prompt came, and
  p50 / p99 / max while it was prefilled (from its sending to its first
  token), and the ratio p99 during / median before; the median once the long
  prompt and the probe have ended (the streams alone again, "after"), and the
  ratio p99 during / the median of the gaps before and after together
  ("p99/without": a host whose decode step moves between a fast and a slow
  mode is then not judged by whichever one the window before caught);
* the long prompt's time to first token and prompt tokens/s;
* the short probe's time to first token;
* the keep-alive comments the long stream received before its first token;
* with ``--long-max-tokens`` above a few, while the long prompt then decodes:
  the streams' time between tokens (p50 / p99) and the long stream's own
  (median). mlx-lm pads every decoding sequence to the longest one, so this is
  where ``--decode-lane-padding`` shows (``--variant lanes-off=--decode-lane-padding 0``).

``--variant NAME=ARGS`` adds our server with those flags as a system of its own
(list NAME in ``--systems``), ``--tree NAME=DIR`` our server from another checkout;
the systems alternate round by round.

    .venv/bin/python bench/long_prefill.py --quick              # tiny model, CPU
    python3 bench/long_prefill.py --model DIR --streams 16 --long-tokens 32768 \\
        --systems ours,mlx_lm --out results.json                # a GPU

Writes the records and summary as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import (  # noqa: E402
    PromptBuilder,
    ServerProcess,
    percentile,
    setup_logging,
    variant_environment,
)

log = logging.getLogger("bench.long_prefill")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(system: str, model: str, port: int, extra: list[str]) -> list[str]:
    if system == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
    return [sys.executable, "-m", "api.cli", "--model", model, "--port", str(port),
            "--max-tokens", "4096", *extra]


async def stream_one(client, body: dict[str, Any], rec: dict[str, Any]) -> None:
    """POST a streamed chat completion; record the send time, every content chunk's
    arrival and the keep-alive comments before the first one."""
    rec.update(sent=time.perf_counter(), chunks=[], keepalives=0, status=None, error=None)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = (await resp.aread()).decode(errors="replace")[:300]
                return
            async for line in resp.aiter_lines():
                if line.startswith(":"):
                    if not rec["chunks"]:
                        rec["keepalives"] += 1
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning") or delta.get(
                        "reasoning_content"
                    ):
                        rec["chunks"].append(time.perf_counter())
                        break
    except Exception as exc:  # a benchmark records, it does not stop
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec["ended"] = time.perf_counter()


def body_of(text: str, max_tokens: int, no_stop: dict[str, int] | None = None) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    if no_stop:
        body["logit_bias"] = no_stop
    return body


def stop_bias(model: str) -> dict[str, int]:
    """``logit_bias`` that keeps a model from its end-of-sequence tokens (config.json's)."""
    eos = json.loads((Path(model) / "config.json").read_text()).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return {str(i): -100 for i in ids}


async def run_once(url: str, ns: argparse.Namespace, builder: PromptBuilder,
                   round_index: int) -> dict[str, Any]:
    import httpx
    import trio

    rng = random.Random(f"{ns.seed}-{round_index}")
    streams = [{} for _ in range(ns.streams)]
    long_rec: dict[str, Any] = {}
    probe_rec: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=ns.streams + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        async with trio.open_nursery() as nursery:
            for i, rec in enumerate(streams):
                text = builder.words(ns.stream_prompt_tokens, rng, lead=f"Stream {i} r{round_index}:")
                nursery.start_soon(stream_one, client, body_of(text, ns.stream_tokens, ns.no_stop), rec)
            # Until every stream decodes, then a little more: the "before" window.
            # A stream that ended (a stop token) counts, and so, 2 s after the first
            # stream decodes, does one whose tokens have brought no text yet (a random
            # model's bytes that are no UTF-8).
            with trio.fail_after(300):
                while not any(len(r.get("chunks", ())) >= 2 for r in streams):  # noqa: ASYNC110
                    await trio.sleep(0.01)
            with trio.move_on_after(2.0):
                while not all(len(r.get("chunks", ())) >= 2 or "ended" in r  # noqa: ASYNC110
                              for r in streams):
                    await trio.sleep(0.01)
            await trio.sleep(ns.before_s)
            long_text = builder.words(ns.long_tokens, rng, lead=f"Long r{round_index}:")
            nursery.start_soon(stream_one, client,
                               body_of(long_text, ns.long_max_tokens, ns.no_stop), long_rec)
            await trio.sleep(ns.probe_after_s)
            probe_text = builder.words(ns.stream_prompt_tokens, rng, lead=f"Probe r{round_index}:")
            nursery.start_soon(stream_one, client, body_of(probe_text, 8), probe_rec)
    return summarize(streams, long_rec, probe_rec, ns)


def gaps(times: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive chunks whose later chunk lies in [lo, hi]."""
    return [b - a for a, b in zip(times, times[1:], strict=False) if lo <= b <= hi]


def summarize(streams, long_rec, probe_rec, ns) -> dict[str, Any]:
    sent = long_rec.get("sent")
    first = long_rec["chunks"][0] if long_rec.get("chunks") else None
    before, during = [], []
    for rec in streams:
        chunks = rec.get("chunks", [])
        if sent is not None:
            before += gaps(chunks, chunks[0] if chunks else 0.0, sent)
        if sent is not None and first is not None:
            during += gaps(chunks, sent, first)
    # A stream whose last chunk came before the long prompt's first token and that
    # had not finished: its open gap counts too (a stalled stream sends nothing).
    med_before = statistics.median(before) if before else None
    p99_during = percentile(during, 99) if during else None
    ttft_long = (first - sent) if (first is not None and sent is not None) else None
    probe_first = probe_rec["chunks"][0] if probe_rec.get("chunks") else None
    # While the long prompt decodes: from its first token to its last.
    long_chunks = long_rec.get("chunks") or []
    after = [g for rec in streams for g in gaps(rec.get("chunks", []), long_chunks[0],
                                                 long_chunks[-1])] if len(long_chunks) > 1 else []
    long_gaps = gaps(long_chunks, long_chunks[0], long_chunks[-1]) if long_chunks else []
    # Once the long prompt and the probe have ended, the streams decode alone again:
    # a second window without the prefill, so that a host whose decode step moves
    # between a fast and a slow mode is not judged by whichever one the first caught.
    quiet = max((rec["chunks"][-1] for rec in (long_rec, probe_rec) if rec.get("chunks")),
                default=None)
    alone_after = [g for rec in streams for g in gaps(rec.get("chunks", []), quiet, math.inf)
                   ] if quiet is not None and first is not None else []
    med_without = statistics.median(before + alone_after) if before or alone_after else None
    return {
        "streams": len(streams),
        "long_tokens": ns.long_tokens,
        "itl_before_p50_ms": _ms(med_before),
        "itl_during_p50_ms": _ms(statistics.median(during) if during else None),
        "itl_during_p99_ms": _ms(p99_during),
        "itl_during_max_ms": _ms(max(during) if during else None),
        "gaps_during": len(during),
        "p99_during_over_p50_before": (p99_during / med_before)
        if (p99_during and med_before) else None,
        "itl_after_p50_ms": _ms(statistics.median(alone_after) if alone_after else None),
        "gaps_after": len(alone_after),
        "p99_during_over_p50_without": (p99_during / med_without)
        if (p99_during and med_without) else None,
        "long_ttft_s": ttft_long,
        "long_prompt_tok_s": (ns.long_tokens / ttft_long) if ttft_long else None,
        "long_keepalives": long_rec.get("keepalives"),
        "probe_ttft_s": (probe_first - probe_rec["sent"]) if probe_first else None,
        "itl_long_decoding_p50_ms": _ms(statistics.median(after) if after else None),
        "itl_long_decoding_p99_ms": _ms(percentile(after, 99) if after else None),
        "gaps_long_decoding": len(after),
        "long_itl_p50_ms": _ms(statistics.median(long_gaps) if long_gaps else None),
        "long_tokens_out": len(long_chunks),
        "errors": [r["error"] for r in [*streams, long_rec, probe_rec] if r.get("error")],
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else 1000 * v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: a tiny model built here)")
    p.add_argument("--systems", default="ours", help="comma list: ours, mlx_lm")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=1024, help="max_tokens of each stream")
    p.add_argument("--stream-prompt-tokens", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=32768)
    p.add_argument("--before-s", type=float, default=1.0)
    p.add_argument("--probe-after-s", type=float, default=0.3)
    p.add_argument("--warm-streams", type=int, default=2,
                   help="streams in the unmeasured warm-up run beside the long prompt "
                   "(--streams: the measured round meets no new batch size)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-max-tokens", type=int, default=8,
                   help="max_tokens of the long prompt (raise it to measure its decoding)")
    p.add_argument("--no-stop", action="store_true",
                   help="bias the model's end-of-sequence tokens out (logit_bias), so that every "
                   "stream decodes all its tokens (random-weight models stop anywhere)")
    p.add_argument("--server-args", default="", help="extra flags for ours")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="our server with ARGS as system NAME (list it in --systems); ARGS's "
                   "leading VARIABLE=VALUE words go to its environment (e.g. "
                   "'MLX_CUDA_GRAPH_CACHE_SIZE=4000 --paced-step-tokens 128')")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="system NAME is our server run from DIR, a checkout of another build "
                   "(e.g. a git worktree), with --server-args or its --variant flags")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--quick", action="store_true",
                   help="tiny model: 4 streams, a 1,500-token long prompt")
    ns = p.parse_args(argv)
    setup_logging()
    if ns.quick:
        ns.streams, ns.long_tokens, ns.stream_tokens, ns.before_s = 4, 1400, 500, 0.3
    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path("/tmp/long-prefill-model"), seed=0))
    builder = PromptBuilder(model)
    ns.no_stop = stop_bias(model) if ns.no_stop else None
    import trio

    variants = dict(v.split("=", 1) for v in ns.variant)
    trees = {name: Path(tree).resolve() for name, tree in (t.split("=", 1) for t in ns.tree)}
    results = []
    for round_index in range(ns.rounds):
        for system in ns.systems.split(","):
            port = free_port()
            environment, extra = variant_environment(variants.get(system, ns.server_args))
            server = ServerProcess(system, server_argv(system, model, port, extra),
                                   f"http://127.0.0.1:{port}",
                                   Path("/tmp") / f"long-prefill-{system}-{port}.log")
            server.start(cwd=trees.get(system, Path(__file__).resolve().parent.parent),
                         env=environment)
            try:
                server.wait_healthy()
                # Warm-up, unmeasured: --warm-streams streams and the long prompt (the
                # kernels and shapes a first meeting builds; as many streams as the
                # measured round also meets its batch sizes' shapes beside a chunk).
                warm = argparse.Namespace(**{**vars(ns), "streams": ns.warm_streams,
                                             "before_s": 0.1})
                trio.run(run_once, server.url, warm, builder, 1000 + round_index)
                result = trio.run(run_once, server.url, ns, builder, round_index)
            finally:
                server.stop()
            result.update(system=system, round=round_index)
            results.append(result)
            print(json.dumps(result), flush=True)
            if ns.out:  # after every run: a run cut short by a time limit keeps the others
                Path(ns.out).write_text(json.dumps({"argv": sys.argv, "results": results},
                                                   indent=1))
    print(f"{'system':8} {'rnd':>3} {'before p50':>10} {'during p50':>10} {'p99':>8} "
          f"{'max':>8} {'p99/p50':>7} {'after p50':>9} {'p99/without':>11} "
          f"{'long ttft':>9} {'tok/s':>8} {'probe':>7} {'keep':>5} "
          f"{'decoding p50':>12} {'p99':>7} {'long itl':>8}")
    for r in results:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        print(f"{r['system']:8} {r['round']:>3} {f(r['itl_before_p50_ms'], '10.1f')} "
              f"{f(r['itl_during_p50_ms'], '10.1f')} {f(r['itl_during_p99_ms'], '8.1f')} "
              f"{f(r['itl_during_max_ms'], '8.1f')} {f(r['p99_during_over_p50_before'], '7.2f')} "
              f"{f(r.get('itl_after_p50_ms'), '9.1f')} "
              f"{f(r.get('p99_during_over_p50_without'), '11.2f')} "
              f"{f(r['long_ttft_s'], '9.2f')} {f(r['long_prompt_tok_s'], '8.0f')} "
              f"{f(r['probe_ttft_s'], '7.2f')} {f(r['long_keepalives'], '5d')} "
              f"{f(r['itl_long_decoding_p50_ms'], '12.1f')} "
              f"{f(r['itl_long_decoding_p99_ms'], '7.1f')} {f(r['long_itl_p50_ms'], '8.1f')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
