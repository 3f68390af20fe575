"""Async HTTP load generator for OpenAI-compatible servers (the benchmarks' client).

Owns the client side of the benchmark and the pieces every bench script shares:

* ``Workload`` and ``PromptBuilder``: deterministic prompts of about N tokens built
  from a word list (counted with the model's ``tokenizer.json`` when given, so the
  engine-ceiling runner can rebuild exactly the same prompts), an optional shared
  long system prompt, chat or text endpoint, streaming on/off, max_tokens, the
  sampling (greedy by default; ``temperature`` / ``top_p``, varied over four
  sets with ``mixed_sampling`` or drawn per request with ``distinct_sampling``)
  and structured outputs (``constrained``: a ``response_format`` on a share of
  the chat requests, ``BENCH_SCHEMA``).
* ``run_level``: keeps ``concurrency`` requests in flight (a closed loop: each client
  sends its next request as soon as the previous one ends) until ``requests`` are
  done, with ``httpx.AsyncClient`` on trio. A disconnect-storm mode makes clients
  leave after ``k`` content chunks.
* ``proc_tree_stats``: CPU seconds and RSS of a server process and its live
  descendants, read from ``/proc/<pid>/stat`` and ``/proc/<pid>/status``.
* ``summarize``: pools one or more runs into output tokens/s, TTFT / inter-chunk /
  end-to-end percentiles, errors by status, and server CPU seconds per token.
* ``ServerProcess``: start a server command, wait for ``/health``, stop it.

Tokens are counted from the final usage chunk (``stream_options.include_usage``);
a request cut short by EOS yields fewer than ``max_tokens`` and the actual count is
what is reported. Inter-token latency is measured between *content chunks*: a
server that merges several tokens into one chunk shows larger gaps and a
``tokens_per_chunk`` above 1, so read the two together (``tpot`` gives the
per-token view: (last chunk - first chunk) / (tokens - 1) per request).

Run ``python bench/loadgen.py --help``; it prints one summary line per level.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.loadgen")

WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education weather river garden window "
    "morning bridge music letter table paper summer winter travel market station "
    "answer simple quick brown fox lazy dog jumps over under between before after "
    "think know want tell give find take come make look use call keep help show hear "
    "play run move live believe bring happen write provide sit stand lose pay meet "
    "include continue set learn lead understand watch follow stop create speak read "
    "spend grow open walk win offer remember love consider appear buy wait serve die "
    "send expect build stay fall cut reach kill remain suggest raise pass sell require"
).split()


# ----------------------------------------------------------------------- workload

# The constrained requests' schema: a list of weather reports (strings, a bounded
# integer, an enum) that cannot be finished within a benchmark's max_tokens
# (minItems), so a constrained request is masked at every token and generates as
# many tokens as a free one; any model can follow it (random weights included).
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "temp", "sky"],
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "temp": {"type": "integer", "minimum": -50, "maximum": 50},
            "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        },
    },
}
RESPONSE_FORMATS = {
    "json_schema": {"type": "json_schema",
                    "json_schema": {"name": "reports", "schema": BENCH_SCHEMA, "strict": True}},
    "json_object": {"type": "json_object"},
}


@dataclass(frozen=True)
class Workload:
    """What every request of a run looks like."""

    prompt_tokens: int = 110
    # request i's prompt: prompt_tokens plus a seeded draw from [-spread, spread], so that
    # the prompts' lengths (and a batch's prefill shapes) do not repeat from wave to wave
    prompt_tokens_spread: int = 0
    max_tokens: int = 64
    stream: bool = True
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "text" (/v1/completions)
    system_prompt_tokens: int = 0  # shared by all requests: prompt-cache effects
    disconnect_after: int | None = None  # leave after this many content chunks
    disconnect_fraction: float = 1.0  # of the requests, the share that leaves early
    seed: int = 0
    timeout_s: float = 600.0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    mixed_sampling: bool = False  # vary temperature / top_p from request to request
    # every request its own temperature, top_p, top_k, drawn at random (as arbitrary clients)
    distinct_sampling: bool = False
    constrained: str | None = None  # "json_schema" (BENCH_SCHEMA) or "json_object"
    constrained_fraction: float = 1.0  # of the requests, the share with a response_format
    # chat requests' enable_thinking (None: the template's default); a constrained
    # request always has it off
    enable_thinking: bool | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "text"):
            raise ValueError(f"endpoint must be chat or text, got {self.endpoint!r}")
        if self.disconnect_after is not None and not self.stream:
            raise ValueError("the disconnect storm needs streaming")
        if self.constrained not in (None, "json_schema", "json_object"):
            raise ValueError(f"constrained must be json_schema or json_object, not {self.constrained!r}")
        if self.constrained and self.endpoint != "chat":
            raise ValueError("constrained requests need the chat endpoint")
        if not 0 <= self.prompt_tokens_spread < self.prompt_tokens:
            raise ValueError("prompt_tokens_spread must be at least 0 and below prompt_tokens")

    def is_constrained(self, index: int) -> bool:
        if self.constrained is None:
            return False
        return random.Random(f"{self.seed}-constrain-{index}").random() < self.constrained_fraction

    def leaves_early(self, index: int) -> bool:
        if self.disconnect_after is None:
            return False
        return random.Random(f"{self.seed}-leave-{index}").random() < self.disconnect_fraction


class PromptBuilder:
    """Deterministic prompts of about ``n`` tokens; exact when a tokenizer is given.

    ``model_path`` may name a model directory holding ``tokenizer.json``; without
    it a word counts as 1.3 tokens. Request ``i`` of a workload gets the same text
    in every process, so the HTTP clients and the engine runner see one workload.
    """

    def __init__(self, model_path: str | os.PathLike | None = None) -> None:
        self._tokenizer = None
        if model_path is not None:
            tok_file = Path(model_path) / "tokenizer.json"
            if tok_file.is_file():
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(tok_file))
        self._word_cost: dict[str, int] = {}

    def _cost(self, word: str) -> float:
        if self._tokenizer is None:
            return 1.3
        cost = self._word_cost.get(word)
        if cost is None:
            ids = self._tokenizer.encode(" " + word, add_special_tokens=False).ids
            cost = self._word_cost[word] = len(ids)
        return cost

    def words(self, n_tokens: int, rng: random.Random, lead: str = "") -> str:
        parts = [lead] if lead else []
        total = self._cost(lead) if lead else 0.0
        while total < n_tokens:
            word = rng.choice(WORDS)
            parts.append(word)
            total += self._cost(word)
        return " ".join(parts)

    def system_prompt(self, w: Workload) -> str | None:
        if not w.system_prompt_tokens:
            return None
        rng = random.Random(f"{w.seed}-system")
        return self.words(w.system_prompt_tokens, rng, lead="You are a helpful assistant.")

    def user_prompt(self, w: Workload, index: int) -> str:
        rng = random.Random(f"{w.seed}-user-{index}")
        # The request number first: distinct prompts diverge early (no accidental
        # prompt-cache hits between requests beyond the shared system prompt).
        length = w.prompt_tokens
        if w.prompt_tokens_spread:
            spread = w.prompt_tokens_spread
            length += random.Random(f"{w.seed}-length-{index}").randint(-spread, spread)
        return self.words(length, rng, lead=f"Request {index}:")

    def messages(self, w: Workload, index: int) -> list[dict[str, str]]:
        msgs = []
        system = self.system_prompt(w)
        if system is not None:
            msgs.append({"role": "system", "content": system})
        msgs.append({"role": "user", "content": self.user_prompt(w, index)})
        return msgs

    def text_prompt(self, w: Workload, index: int) -> str:
        system = self.system_prompt(w)
        user = self.user_prompt(w, index)
        return user if system is None else f"{system}\n\n{user}"

    def payload(self, w: Workload, index: int) -> tuple[str, dict[str, Any]]:
        temperature, top_p = sampling_of(w, index)
        body: dict[str, Any] = {"max_tokens": w.max_tokens, "temperature": temperature}
        if top_p < 1.0:
            body["top_p"] = top_p
        if w.distinct_sampling and temperature > 0:
            body["top_k"] = random.Random(f"{w.seed}-top-k-{index}").choice([0, 20, 50])
        if w.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if w.endpoint == "chat":
            body["messages"] = self.messages(w, index)
            if w.enable_thinking is not None:
                body["chat_template_kwargs"] = {"enable_thinking": w.enable_thinking}
            if w.is_constrained(index):
                body["response_format"] = RESPONSE_FORMATS[w.constrained]
                body["chat_template_kwargs"] = {"enable_thinking": False}
            return "/v1/chat/completions", body
        body["prompt"] = self.text_prompt(w, index)
        return "/v1/completions", body


# ------------------------------------------------------------- process statistics

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read_stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, own cpu seconds, waited-for children's cpu seconds) of one process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid=4, utime=14, stime=15, cutime=16, cstime=17.
    ppid = int(fields[1])
    own = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    reaped = (int(fields[13]) + int(fields[14])) / _CLK_TCK
    return ppid, own, reaped


def _read_status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _read_stat(int(entry))
        if st is not None:
            children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def proc_tree_stats(pid: int | None) -> dict[str, float] | None:
    """CPU seconds (user+system, the process, its live descendants and reaped
    children; ``root_cpu_s``: the process alone, for mlx-trio-server its API
    process, the rest its engine process) and RSS / peak RSS in MiB (summed over
    the tree) of ``pid``."""
    if pid is None:
        return None
    root = _read_stat(pid)
    if root is None:
        return None
    cpu = root[1] + root[2]
    pids = [pid, *descendants(pid)]
    for child in pids[1:]:
        st = _read_stat(child)
        if st is not None:
            cpu += st[1]
    rss = sum(_read_status_kb(p, "VmRSS") for p in pids) / 1024
    hwm = sum(_read_status_kb(p, "VmHWM") for p in pids) / 1024
    return {
        "cpu_s": cpu,
        "root_cpu_s": root[1],
        "rss_mb": rss,
        "peak_rss_mb": hwm,
        "processes": len(pids),
    }


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# --------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool runs (``run_level`` or engine results) of one system at one level.

    Throughput pools as total tokens / total wall time; CPU as total CPU / total
    tokens; latency percentiles over all requests (or chunk gaps) of all runs.
    """

    def cat(key: str) -> list[float]:
        return [v for r in runs for v in r.get(key, [])]

    tokens = sum(r["completion_tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    chunks = sum(r.get("content_chunks", 0) for r in runs)
    requests = sum(r["requests"] for r in runs)
    errors: Counter[str] = Counter()
    for r in runs:
        errors.update(r.get("errors", {}))
    cpu = [r["cpu_s"] for r in runs if r.get("cpu_s") is not None]
    client_cpu = [r["client_cpu_s"] for r in runs if r.get("client_cpu_s") is not None]
    root_cpu = [r["root_cpu_s"] for r in runs if r.get("root_cpu_s") is not None]
    ttft, itl, e2e, tpot = cat("ttft_s"), cat("itl_s"), cat("e2e_s"), cat("tpot_s")
    prompt_tokens = cat("prompt_tokens")
    peak = [r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb") is not None]
    out = {
        "runs": len(runs),
        "requests": requests,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "mean_completion_tokens": round(tokens / requests, 1) if requests else None,
        "mean_prompt_tokens": (
            round(sum(prompt_tokens) / len(prompt_tokens), 1) if prompt_tokens else None
        ),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p95_ms": _ms(percentile(ttft, 95)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)),
        "itl_p99_ms": _ms(percentile(itl, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)),
        "e2e_p95_ms": _ms(percentile(e2e, 95)),
        "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "tokens_per_chunk": round(tokens / chunks, 2) if chunks else None,
        "errors": dict(errors),
        "error_samples": sorted({e for r in runs for e in r.get("error_samples", [])})[:5],
        "disconnects": sum(r.get("disconnects", 0) for r in runs),
        "cpu_s": round(sum(cpu), 3) if cpu else None,
        "cpu_ms_per_token": round(1000 * sum(cpu) / tokens, 3) if cpu and tokens else None,
        # The server's own process alone (mlx-trio-server: the API process).
        "root_cpu_ms_per_token": (
            round(1000 * sum(root_cpu) / tokens, 3) if root_cpu and tokens else None
        ),
        "client_cpu_ms_per_token": (
            round(1000 * sum(client_cpu) / tokens, 3) if client_cpu and tokens else None
        ),
        "peak_rss_mb": round(max(peak), 1) if peak else None,
    }
    busy = [r["engine_busy_s"] for r in runs if r.get("engine_busy_s") is not None]
    if busy and wall > 0:
        # The engine's share of the wall time spent stepping, and its steps.
        out["engine_busy_pct"] = round(100 * sum(busy) / wall, 1)
        out["engine_steps"] = sum(r["engine_steps"] for r in runs)
        out["engine_prefill_steps"] = sum(r["engine_prefill_steps"] for r in runs)
    drains = [r["drain_s"] for r in runs if r.get("drain_s") is not None]
    if drains:
        out["drain_after_storm_ms"] = _ms(max(drains))
    return out


# ------------------------------------------------------------------------ client


@dataclass
class _Record:
    index: int
    start: float
    end: float = 0.0
    status: int | None = None
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    disconnected: bool = False


def _has_content(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or choice.get("message") or {}
    return bool(
        delta.get("content")
        or delta.get("reasoning")
        or delta.get("reasoning_content")
        or delta.get("tool_calls")
    )


async def _one_request(client, w: Workload, builder: PromptBuilder, index: int) -> _Record:
    import httpx

    path, body = builder.payload(w, index)
    # Our server logs it (access log, request trace): the client's and the server's
    # records of one request can be joined (mlx_lm.server ignores it).
    headers = {"x-request-id": f"loadgen-{index}"}
    leave_after = w.disconnect_after if w.leaves_early(index) else None
    rec = _Record(index=index, start=time.perf_counter())
    try:
        if not w.stream:
            resp = await client.post(path, json=body, headers=headers)
            rec.status = resp.status_code
            if resp.status_code == 200:
                data = resp.json()
                usage = data.get("usage") or {}
                rec.completion_tokens = usage.get("completion_tokens")
                rec.prompt_tokens = usage.get("prompt_tokens")
            else:
                rec.error = resp.text[:200]
            return rec
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:200]
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = json.dumps(obj["error"])[:200]
                    rec.status = -1
                    break
                usage = obj.get("usage")
                if usage:
                    rec.completion_tokens = usage.get("completion_tokens")
                    rec.prompt_tokens = usage.get("prompt_tokens")
                if any(_has_content(c) for c in obj.get("choices") or ()):
                    rec.chunk_times.append(now)
                    if leave_after is not None and len(rec.chunk_times) >= leave_after:
                        rec.disconnected = True
                        break
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        rec.end = time.perf_counter()
    return rec


def _result_from_records(records: list[_Record], wall: float, w: Workload) -> dict[str, Any]:
    errors: Counter[str] = Counter()
    ttft, itl, e2e, tpot, prompt_tokens = [], [], [], [], []
    tokens = chunks = disconnects = 0
    samples: list[str] = []
    for r in records:
        if r.error is not None or r.status != 200:
            errors[str(r.status) if r.status is not None else (r.error or "?").split(":")[0]] += 1
            sample = f"{r.status}: {r.error}"
            if len(samples) < 5 and sample not in samples:
                samples.append(sample)
            continue
        n = r.completion_tokens
        if r.disconnected:
            disconnects += 1
            n = len(r.chunk_times)  # no usage chunk: at least one token per chunk
        if n is None:
            n = len(r.chunk_times)
            errors["no_usage"] += 1
        tokens += n
        chunks += len(r.chunk_times)
        if r.prompt_tokens is not None:
            prompt_tokens.append(r.prompt_tokens)
        if not r.disconnected:
            e2e.append(r.end - r.start)
        if r.chunk_times:
            ttft.append(r.chunk_times[0] - r.start)
            itl.extend(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False))
            if n > 1 and len(r.chunk_times) > 1:
                tpot.append((r.chunk_times[-1] - r.chunk_times[0]) / (n - 1))
    return {
        "requests": len(records),
        "completion_tokens": tokens,
        "content_chunks": chunks if w.stream else 0,
        "wall_s": wall,
        "errors": dict(errors),
        "error_samples": samples,
        "disconnects": disconnects,
        "ttft_s": ttft,
        "itl_s": itl,
        "e2e_s": e2e,
        "tpot_s": tpot,
        "prompt_tokens": prompt_tokens,
    }


async def _probe_drain(client, limit_s: float = 10.0) -> float | None:
    """Seconds until ``/health`` reports no request in flight (servers that say so)."""
    import trio

    t0 = time.perf_counter()
    with trio.move_on_after(limit_s):
        while True:
            try:
                body = (await client.get("/health")).json()
            except Exception:
                return None
            busy = body.get("requests_in_flight", body.get("active_sequences"))
            if busy is None:
                return None
            if busy == 0:
                return time.perf_counter() - t0
            await trio.sleep(0.005)
    return None


async def _run_level_async(
    url: str,
    w: Workload,
    concurrency: int,
    requests: int,
    builder: PromptBuilder,
    pid: int | None,
    first_index: int,
) -> dict[str, Any]:
    import httpx
    import trio

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(w.timeout_s, connect=30.0)
    records: list[_Record] = []
    indices = iter(range(first_index, first_index + requests))

    async def client_task(client) -> None:
        for index in indices:
            records.append(await _one_request(client, w, builder, index))

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        engine_before = await engine_counters(client)
        before = proc_tree_stats(pid)
        client_before = self_cpu_s()
        t0 = time.perf_counter()
        epoch_offset = time.time() - t0
        async with trio.open_nursery() as nursery:
            for _ in range(min(concurrency, requests)):
                nursery.start_soon(client_task, client)
        wall = time.perf_counter() - t0
        client_cpu = self_cpu_s() - client_before
        after = proc_tree_stats(pid)
        engine_after = await engine_counters(client)
        drain = await _probe_drain(client) if w.disconnect_after is not None else None
    result = _result_from_records(sorted(records, key=lambda r: r.index), wall, w)
    # (index, sent, first content chunk or None, end) in epoch seconds, for traces
    result["request_epochs"] = [
        (
            r.index,
            r.start + epoch_offset,
            r.chunk_times[0] + epoch_offset if r.chunk_times else None,
            r.end + epoch_offset,
        )
        for r in sorted(records, key=lambda r: r.index)
    ]
    result["client_cpu_s"] = client_cpu
    if before is not None and after is not None:
        result["cpu_s"] = after["cpu_s"] - before["cpu_s"]
        result["root_cpu_s"] = after["root_cpu_s"] - before["root_cpu_s"]
        result["peak_rss_mb"] = after["peak_rss_mb"]
        result["rss_mb"] = after["rss_mb"]
    result["drain_s"] = drain
    if engine_before and engine_after:
        for key in ENGINE_COUNTERS.values():
            result[key] = engine_after[key] - engine_before[key]
    return result


# mlx-trio-server's /metrics counters that tell where a server's time went:
# the engine busy stepping (vs idle, waiting for requests) and how many steps.
ENGINE_COUNTERS = {
    "mlx_trio_engine_busy_seconds_total": "engine_busy_s",
    "mlx_trio_engine_steps_total": "engine_steps",
    "mlx_trio_engine_prefill_steps_total": "engine_prefill_steps",
}


async def engine_counters(client) -> dict[str, float] | None:
    """The server's engine counters from ``/metrics``, or None (mlx_lm.server has none)."""
    import httpx

    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    found = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_COUNTERS:
            found[ENGINE_COUNTERS[name]] = float(value)
    return found if len(found) == len(ENGINE_COUNTERS) else None


def run_level(
    url: str,
    workload: Workload,
    concurrency: int,
    requests: int,
    builder: PromptBuilder | None = None,
    pid: int | None = None,
    first_index: int = 0,
) -> dict[str, Any]:
    """One closed-loop run against ``url``: raw per-request data, for ``summarize``.

    Requests ``first_index`` .. ``first_index + requests - 1`` of the workload are
    sent: give each run its own range, or a server's prompt cache will find the
    previous run's prompts and skip their prefill.
    """
    import trio

    builder = builder or PromptBuilder()
    return trio.run(
        _run_level_async, url, workload, concurrency, requests, builder, pid, first_index
    )


def warm_up(url: str, w: Workload, builder: PromptBuilder | None = None) -> dict[str, Any]:
    """Two short requests shaped like ``w`` (own prompt seed): first-call costs off the clock."""
    # the same sampling and constraints (their first-call costs too), no disconnects
    warm = replace(w, max_tokens=4, seed=w.seed + 1000, disconnect_after=None)
    result = run_level(url, warm, 2, 2, builder)
    if result["errors"]:
        raise RuntimeError(f"{url}: warm-up failed: {result['errors']}")
    return result


def default_requests(concurrency: int, per_client: int = 2) -> int:
    return max(8, per_client * concurrency)


def requests_for(ns: argparse.Namespace, concurrency: int) -> int:
    """``--requests``, else ``--requests-per-client`` (default 2) times the level, at least 8."""
    if ns.requests:
        return ns.requests
    return default_requests(concurrency, getattr(ns, "requests_per_client", None) or 2)


# ---------------------------------------------------------------- server process


class ServerProcess:
    """A server started from ``argv``, its output in ``log_path``; we own its pid."""

    def __init__(self, name: str, argv: list[str], url: str, log_path: Path) -> None:
        self.name, self.argv, self.url, self.log_path = name, argv, url, log_path
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(
        self, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None
    ) -> None:
        """``env``: variables added to this process's environment for the server."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env={**os.environ, **env} if env else None,
            )
        log.info("%s: started pid %d: %s", self.name, self.proc.pid, shlex.join(self.argv))

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 300.0) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit on %s", self.name, signal.Signals(sig).name)
        return None


# --------------------------------------------------------------------------- CLI


def variant_environment(args: str) -> tuple[dict[str, str], list[str]]:
    """A variant's leading ``VARIABLE=VALUE`` words (upper-case names: the server's
    environment) and the flags after them, split as a shell would."""
    words = shlex.split(args)
    environment = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    return environment, words


def progress_reporter(log: logging.Logger):
    """A benchmark's progress lines: on a terminal, a timestamped line on stderr;
    otherwise a record of ``log``."""

    def progress(msg: str) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
            sys.stderr.flush()
        else:
            log.info("%s", msg)

    return progress


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels: comma-separated positive integers")
    return levels


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--levels", type=parse_levels, default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=None, help="per level (default max(8, 2c))")
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=None,
        help="without --requests: this many per client at each level (default 2); more "
        "requests let a run's first burst and last drain weigh less",
    )
    p.add_argument("--prompt-tokens", type=int, default=110)
    p.add_argument("--prompt-tokens-spread", type=int, default=0,
                   help="each prompt's length drawn from --prompt-tokens +- this (seeded), "
                   "so that prompt lengths do not repeat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--endpoint", choices=("chat", "text"), default="chat")
    p.add_argument("--system-prompt-tokens", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--mixed-sampling",
        action="store_true",
        help="vary temperature and top_p around the given values, request by request",
    )
    p.add_argument("--distinct-sampling", action="store_true",
                   help="every request its own temperature (x0.7-1.3), top_p (0.8-1) and "
                   "top_k (0, 20 or 50; HTTP only)")
    p.add_argument("--constrained", choices=("json_schema", "json_object"), default=None,
                   help="chat requests with this response_format (json_schema: BENCH_SCHEMA)")
    p.add_argument("--constrained-fraction", type=float, default=1.0)


def sampling_of(w: Workload, index: int) -> tuple[float, float]:
    """Request ``index``'s temperature and top_p (the same in every process)."""
    if w.temperature == 0 or not (w.mixed_sampling or w.distinct_sampling):
        return w.temperature, w.top_p
    if w.distinct_sampling:
        rng = random.Random(f"{w.seed}-sampling-{index}")
        return round(w.temperature * rng.uniform(0.7, 1.3), 4), round(rng.uniform(0.8, 1.0), 4)
    step = index % 4
    return round(w.temperature * (0.75 + 0.125 * step), 4), min(1.0, w.top_p + 0.02 * step)


def workload_from_args(ns: argparse.Namespace) -> Workload:
    return Workload(
        prompt_tokens=ns.prompt_tokens,
        prompt_tokens_spread=getattr(ns, "prompt_tokens_spread", 0),
        max_tokens=ns.max_tokens,
        stream=ns.stream,
        endpoint=ns.endpoint,
        system_prompt_tokens=ns.system_prompt_tokens,
        disconnect_after=getattr(ns, "disconnect_after", None),
        disconnect_fraction=getattr(ns, "disconnect_fraction", 1.0),
        seed=ns.seed,
        temperature=getattr(ns, "temperature", 0.0),
        top_p=getattr(ns, "top_p", 1.0),
        mixed_sampling=getattr(ns, "mixed_sampling", False),
        distinct_sampling=getattr(ns, "distinct_sampling", False),
        constrained=getattr(ns, "constrained", None),
        constrained_fraction=getattr(ns, "constrained_fraction", 1.0),
    )


def format_summary(level: int, s: dict[str, Any]) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    return (
        f"c={level:<3} req={s['requests']:<4} tok={s['completion_tokens']:<6} "
        f"tok/s={f(s['tok_s'])} ttft p50/p95/p99={f(s['ttft_p50_ms'])}/"
        f"{f(s['ttft_p95_ms'])}/{f(s['ttft_p99_ms'])} ms "
        f"itl p50/p99={f(s['itl_p50_ms'])}/{f(s['itl_p99_ms'])} ms "
        f"tok/chunk={f(s['tokens_per_chunk'], '.2f')} "
        f"e2e p50/p99={f(s['e2e_p50_ms'])}/{f(s['e2e_p99_ms'])} ms "
        f"cpu/tok={f(s['cpu_ms_per_token'], '.3f')} ms peak_rss={f(s['peak_rss_mb'])} MiB "
        f"errors={s['errors'] or 0} disconnects={s['disconnects']}"
        + (f" drain={s['drain_after_storm_ms']} ms" if "drain_after_storm_ms" in s else "")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--pid", type=int, default=None, help="server pid for CPU / RSS figures")
    p.add_argument(
        "--spawn",
        default=None,
        help="start this server command (gives --pid; its log goes to bench/results/logs/)",
    )
    p.add_argument("--model", default=None, help="model dir: its tokenizer.json sizes prompts")
    p.add_argument("--disconnect-after", type=int, default=None, metavar="K")
    p.add_argument("--disconnect-fraction", type=float, default=1.0)
    p.add_argument("--json-out", default=None)
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True)
    add_workload_args(p)
    ns = p.parse_args(argv)
    setup_logging()
    w = workload_from_args(ns)
    builder = PromptBuilder(ns.model)
    server = None
    pid = ns.pid
    if ns.spawn:
        log_path = Path(__file__).resolve().parent / "results" / "logs"
        log_path /= f"loadgen-{time.strftime('%Y%m%d-%H%M%S')}.log"
        server = ServerProcess("server", shlex.split(ns.spawn), ns.url, log_path)
        server.start()
        server.wait_healthy()
        pid = server.pid
    results = {}
    first_index = 0
    try:
        if ns.warm_up:
            warm_up(ns.url, w, builder)
        for level in ns.levels:
            n = requests_for(ns, level)
            s = summarize([run_level(ns.url, w, level, n, builder, pid, first_index)])
            first_index += n
            results[level] = s
            sys.stdout.write(format_summary(level, s) + "\n")
            sys.stdout.flush()
    finally:
        if server is not None:
            server.stop()
    if ns.json_out:
        Path(ns.json_out).write_text(
            json.dumps({"workload": asdict(w), "levels": results}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
