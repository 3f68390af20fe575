"""Coding agents' traffic: N concurrent sessions of T turns over one shared system prompt.

Measures how a server holds up under the requests coding agents (Claude Code, Codex,
opencode) send: a long system prompt (tool definitions; S tokens), the whole
conversation so far, and a new user turn or tool result of U tokens. Each request
starts with everything the previous one ended with, the reply the server generated
included (sent back as text), so a prompt cache that keeps a session's last turn
can skip all but the new user turn. All N sessions share the system prompt and
start together (turn 1's TTFT is the "sessions that start together" case); each
session sends its next turn as soon as its reply has finished (closed loop), or
``--tool-seconds`` later, as an agent that runs a tool between turns does: then
other sessions' turns finish and are stored meanwhile, and a cache that keeps
fewer entries than there are sessions loses their histories.
Replies are fixed-length (``max_tokens`` = G; a random-weight model may stop
earlier at EOS: the counts come from the usage). With ``--ask-tokens A`` (HTTP
systems), each request asks for ``max_tokens`` = A, as agents do (Claude Code asks
for 64,000), and the client closes the stream after G tokens' chunks, where an
agent's reply would have ended: what a server reserves for a reply then matters.
Such a turn has no usage chunk: its tokens are its content chunks, and its prompt
and cached tokens are unknown.

Three systems, same workload, same prompts:

* ``ours``: ``python -m api.cli --model DIR`` (this project's server);
* ``mlx_lm``: ``python -m mlx_lm server --model DIR`` (mlx-lm's own);
* ``engine``: mlx-lm's ``BatchGenerator`` with mlx-lm's ``LRUPromptCache`` in this
  process, no HTTP, driven as ``mlx_lm.server`` drives it: the chat template
  applied by the tokenizer, the system prompt as its own cached segment,
  ``fetch_nearest_cache`` before the insert, ``insert_cache`` of the prompt and
  generated tokens when a sequence finishes; the reply is the decoded generated
  tokens, re-tokenized with the next turn, as over HTTP.

Systems alternate within a round (``ours, mlx_lm, engine`` at each sessions level,
then the next level; ``--rounds`` times); every server is a fresh process per run
(its prompt cache starts cold) that first serves a short warm-up session, not
counted; the engine gets a fresh generator and prompt cache per run, after its own
warm-up session.

Per turn (the JSON's ``records``): TTFT (request sent -> first streamed token),
the gaps between content chunks (ITL), generated tokens and tokens/s, the prompt
and cached tokens the server reports (``usage.prompt_tokens_details.cached_tokens``
of the final usage chunk; ``mlx_lm.server`` reports it the same way) and
``reusable_tokens``: the previous turn's prompt + generated tokens, what a prompt
cache holding the previous turn covers when the reply re-encodes to the tokens
that were generated (mlx-lm's ``BatchGenerator`` has fed the last generated token
to the model by the time it reports it, so the cache holds every one). The engine
also records ``retokenized_prefix``: how much of the previous turn's tokens the
new prompt does repeat. Per run and sessions level: tokens/s (all generated
tokens / wall time), TTFT p50/p99 for turn 1 and later turns, ITL, cached fraction
(cached / prompt tokens; ``later``: turns 2 and on; ``of reusable``: cached /
reusable tokens over turns 2 and on, the share a cache could have given that it
did give), and the rows decoding at a time on average (each turn's seconds from its
first token to its end, over the wall time).

Caveats: mlx_lm.server and the bare engine keep 10 prompt caches by default, ours
64 (``--prompt-cache-size`` sets all three systems'): past 10 sessions whose turns
wait (for a tool, for a place in the batch), theirs evict a session's last turn
before its next one arrives. A random-weight model's reply, decoded and
re-encoded, need not give back the tokens it generated (the cached tokens then
stop where they part), and one whose vocabulary is larger than its tokenizer's
(``make_shaped_model.py``) mostly generates ids that decode to nothing. A
connection refused or reset before any answer is retried (``retries``), as an
agent would. The tiny model built by default gets a 64k-token window; a
``make_shaped_model.py`` model needs ``--context`` past 2,048 tokens.

    .venv/bin/python bench/agent_sessions.py --quick --plot        # CPU smoke run
    .venv/bin/python bench/agent_sessions.py --model DIR --sessions 1,4,16 --turns 6 \\
        --system-tokens 12000 --user-tokens 200-500 --max-tokens 64 --plot
    .venv/bin/python bench/agent_sessions.py --plot-only bench/results/agent-sessions-X.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import logging
import os
import platform
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # runtime.tiny_model when the package is not installed

from loadgen import (  # noqa: E402
    PromptBuilder,
    ServerProcess,
    percentile,
    proc_tree_stats,
    progress_reporter,
    variant_environment,
)
from loadgen import setup_logging as _setup_logging  # noqa: E402
from side_by_side import free_port, server_argv, versions  # noqa: E402

log = logging.getLogger("bench.agent_sessions")


progress = progress_reporter(log)


SYSTEMS = ("ours", "mlx_lm", "engine")
LABELS = {"ours": "mlx-trio-server", "mlx_lm": "mlx_lm.server", "engine": "engine (in-process)"}
COLORS = {"ours": "tab:blue", "mlx_lm": "tab:orange", "engine": "tab:green"}
VARIANT_COLORS = ("tab:purple", "tab:red", "tab:brown", "tab:olive", "tab:cyan")
# side_by_side.server_argv's names for the two servers
SERVER_KIND = {"ours": "ours", "mlx_lm": "ref"}
PROBE_ENV = "MLX_TRIO_ENGINE_PROBE"  # runtime.engine.host_speed: the engine's step trace
# The engine's batch sizes: the servers' as side_by_side.SERVER_FLAGS sets them
# (--decode-concurrency 64) and their default prompt concurrency (8).
DECODE_CONCURRENCY = 64
PROMPT_CONCURRENCY = 8
DEFAULT_PROMPT_CACHE_SIZE = 10  # mlx_lm.server's default (LRUPromptCache max_size), the engine's
MAX_RETRIES = 3  # a turn whose connection is refused or reset before any answer
TINY_CONTEXT = 65536  # the tiny model's window, widened so that long histories fit

SYSTEM_LEAD = "You are a coding agent. You have these tools and rules:"
WARM_UP_LEAD = "Warm-up agent rules:"  # its first word differs: no prefix shared with the runs

DEFAULTS = {
    "sessions": [1, 4, 16],
    "turns": 6,
    "system_tokens": 12000,
    "user_tokens": (200, 500),
    "max_tokens": (64, 64),
    "rounds": 2,
}
QUICK = {
    "sessions": [1, 4],
    "turns": 3,
    "system_tokens": 1500,
    "user_tokens": (60, 120),
    "max_tokens": (16, 16),
    "rounds": 1,
}


# ----------------------------------------------------------------------- workload


@dataclass(frozen=True)
class AgentWorkload:
    """One run's shape: ``sessions`` sessions of ``turns`` turns over one system prompt."""

    sessions: int = 1
    turns: int = 6
    system_tokens: int = 12000
    user_tokens: tuple[int, int] = (200, 500)  # each turn's length drawn from this range
    max_tokens: tuple[int, int] = (64, 64)  # each turn's max_tokens drawn from this range
    seed: int = 0
    system_lead: str = SYSTEM_LEAD
    # Seconds between a reply and the session's next turn (an agent running a tool),
    # each drawn from this range; (0, 0): the next turn is sent at once.
    tool_seconds: tuple[float, float] = (0.0, 0.0)
    # HTTP systems: the max_tokens each request asks for (None: its reply's length);
    # the client closes the stream after the reply's length.
    ask_tokens: int | None = None

    def user_length(self, session: int, turn: int) -> int:
        return random.Random(f"{self.seed}-user-len-{session}-{turn}").randint(*self.user_tokens)

    def max_tokens_of(self, session: int, turn: int) -> int:
        return random.Random(f"{self.seed}-max-tokens-{session}-{turn}").randint(*self.max_tokens)

    def tool_seconds_of(self, session: int, turn: int) -> float:
        """The pause before ``turn`` (turn 1: none)."""
        if turn == 1 or self.tool_seconds[1] <= 0:
            return 0.0
        return random.Random(f"{self.seed}-tool-{session}-{turn}").uniform(*self.tool_seconds)


class Prompts:
    """The texts of a workload, the same in every system: one system prompt shared by
    all sessions, and a user turn per session and turn (odd turns a user message, even
    turns a tool result sent as a user message: every chat template has that role)."""

    def __init__(self, builder: PromptBuilder, w: AgentWorkload) -> None:
        self.builder, self.w = builder, w
        self._system: str | None = None

    def system(self) -> str:
        if self._system is None:
            rng = random.Random(f"{self.w.seed}-agent-system")
            self._system = self.builder.words(self.w.system_tokens, rng, lead=self.w.system_lead)
        return self._system

    def user(self, session: int, turn: int) -> str:
        # The session and turn first: sessions part ways right after the system prompt.
        rng = random.Random(f"{self.w.seed}-agent-user-{session}-{turn}")
        if turn % 2:
            lead = f"Session {session} turn {turn}: please change the code so that"
        else:
            lead = f"Tool result for session {session} turn {turn}: exit code 0, output:"
        return self.builder.words(self.w.user_length(session, turn), rng, lead=lead)


def turn_messages(history: list[dict[str, str]], user_text: str) -> list[dict[str, str]]:
    """A turn's request: the whole history and the new user turn."""
    return [*history, {"role": "user", "content": user_text}]


class Conversation:
    """A session's history: system, then user / assistant pairs (the replies as given)."""

    def __init__(self, system: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]

    def request(self, user_text: str) -> list[dict[str, str]]:
        return turn_messages(self.messages, user_text)

    def reply(self, request: list[dict[str, str]], text: str) -> None:
        """The request that got ``text`` becomes the history, with the reply after it."""
        self.messages = [*request, {"role": "assistant", "content": text}]


@dataclass
class TurnRecord:
    """One turn of one session, as measured (times in seconds from the run's start)."""

    system: str
    round: int
    sessions: int
    session: int
    turn: int
    max_tokens: int
    user_tokens: int  # the new user turn's target length
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    completion_tokens: int | None = None
    tok_s: float | None = None  # generated tokens / (end - start)
    decode_tok_s: float | None = None  # (tokens - 1) / (last chunk - first chunk)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # previous turn's prompt + generated: what a cache of the previous turn covers
    # when the reply re-encodes to the generated tokens (turn 1: None)
    reusable_tokens: int | None = None
    retokenized_prefix: int | None = None  # engine: prompt's common prefix with that turn
    finish_reason: str | None = None
    reply_chars: int = 0
    reasoning_chars: int = 0  # streamed as reasoning, not sent back in the history
    retries: int = 0  # sent again after a refused or reset connection
    error: str | None = None
    # ours: how long it waited before the engine took it into its batch (the queue for a
    # slot and the KV budget, the engine's hold), from the server's access log (``queued_ms``)
    queued_s: float | None = None

    def finish(self, chunk_times: list[float], end: float) -> None:
        """Latency fields from the content chunks' times (run clock)."""
        self.end_s = end
        if chunk_times:
            self.ttft_s = chunk_times[0] - self.start_s
            self.itl_s = [
                round(b - a, 6) for a, b in zip(chunk_times, chunk_times[1:], strict=False)
            ]
            self.itl_p50_s = percentile(self.itl_s, 50)
            self.itl_p99_s = percentile(self.itl_s, 99)
        n = self.completion_tokens
        if n and end > self.start_s:
            self.tok_s = n / (end - self.start_s)
        if n and n > 1 and len(chunk_times) > 1 and chunk_times[-1] > chunk_times[0]:
            self.decode_tok_s = (n - 1) / (chunk_times[-1] - chunk_times[0])


def reusable_after(prev: TurnRecord | None) -> int | None:
    if prev is None or prev.prompt_tokens is None or not prev.completion_tokens:
        return None
    return prev.prompt_tokens + prev.completion_tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------- HTTP client


def _payload(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def turn_request_id(rec: TurnRecord) -> str:
    """The ``x-request-id`` a turn is sent with (the servers' access logs name it)."""
    return f"agent-{rec.sessions}-{rec.session}-{rec.turn}"


async def _http_turn(
    client, messages, rec: TurnRecord, t0: float, ask_tokens: int | None = None
) -> str:
    """Stream one turn into ``rec``; returns the reply's content (the history's text)."""
    import httpx
    import trio

    headers = {"x-request-id": turn_request_id(rec)}
    content: list[str] = []
    chunk_times: list[float] = []
    try:
        while True:
            try:
                reply = await _stream(
                    client, messages, rec, headers, content, chunk_times, t0, ask_tokens
                )
                break
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # A connection refused or reset before any answer (mlx_lm.server's
                # listen backlog is 5): an agent would send the turn again, so do we.
                if content or chunk_times or rec.retries >= MAX_RETRIES:
                    raise
                rec.retries += 1
                await trio.sleep(0.05 * rec.retries)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        reply = ""
    finally:
        rec.finish(chunk_times, time.perf_counter() - t0)
    if rec.completion_tokens is None and rec.error is None:
        rec.error = "no usage chunk"
    rec.reply_chars = len(reply)
    return reply


async def _stream(
    client, messages, rec: TurnRecord, headers, content, chunk_times, t0, ask_tokens=None
) -> str:
    """One attempt at a turn: its content chunks into ``content`` and ``chunk_times``.
    With ``ask_tokens``: the request asks for that many, and the stream is closed after
    ``rec.max_tokens`` chunks (the turn's tokens)."""
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json=_payload(messages, ask_tokens or rec.max_tokens),
        headers=headers,
    ) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            rec.error = f"{resp.status_code}: {body[:200]}"
            return ""
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter() - t0
            obj = json.loads(data)
            if obj.get("error"):
                rec.error = json.dumps(obj["error"])[:200]
                break
            usage = obj.get("usage")
            if usage:
                rec.completion_tokens = usage.get("completion_tokens")
                rec.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                rec.cached_tokens = details.get("cached_tokens")
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") or {}
                text = delta.get("content") or ""
                reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""
                if text:
                    content.append(text)
                rec.reasoning_chars += len(reasoning)
                if text or reasoning or delta.get("tool_calls"):
                    chunk_times.append(now)
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
            if ask_tokens and len(chunk_times) >= rec.max_tokens and not rec.finish_reason:
                rec.completion_tokens = len(chunk_times)
                rec.finish_reason = "closed"  # where the agent's reply would have ended
                break
    return "".join(content)


async def _run_http_async(
    url: str, w: AgentWorkload, prompts: Prompts, system: str, rnd: int, pid: int | None
) -> dict[str, Any]:
    import httpx
    import trio

    n = w.sessions
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(1800.0, connect=30.0)
    records: list[TurnRecord] = []

    async def session_task(client, session: int, t0: float) -> None:
        conv = Conversation(prompts.system())
        prev: TurnRecord | None = None
        for turn in range(1, w.turns + 1):
            await trio.sleep(w.tool_seconds_of(session, turn))
            rec = TurnRecord(
                system,
                rnd,
                n,
                session,
                turn,
                w.max_tokens_of(session, turn),
                w.user_length(session, turn),
            )
            messages = conv.request(prompts.user(session, turn))
            rec.reusable_tokens = reusable_after(prev)
            rec.start_s = time.perf_counter() - t0
            reply = await _http_turn(client, messages, rec, t0, w.ask_tokens)
            records.append(rec)
            if rec.error is not None:
                log.warning("%s session %d turn %d: %s", system, session, turn, rec.error)
                return  # the session cannot go on without its reply
            conv.reply(messages, reply)
            prev = rec

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        before = proc_tree_stats(pid)
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for session in range(n):
                nursery.start_soon(session_task, client, session, t0)
        wall = time.perf_counter() - t0
        after = proc_tree_stats(pid)
    out: dict[str, Any] = {"wall_s": wall, "records": records}
    if before is not None and after is not None:
        out["cpu_s"] = after["cpu_s"] - before["cpu_s"]
        out["peak_rss_mb"] = after["peak_rss_mb"]
    return out


def run_http(
    url: str, w: AgentWorkload, prompts: Prompts, system: str, rnd: int, pid: int | None = None
) -> dict[str, Any]:
    import trio

    return trio.run(_run_http_async, url, w, prompts, system, rnd, pid)


# ------------------------------------------------------------------------ engine


class EngineSessions:
    """mlx-lm's ``BatchGenerator`` and ``LRUPromptCache`` driven as ``mlx_lm.server``'s
    generation thread drives them, with no HTTP (the model loaded once)."""

    MODEL_KEY = "model"  # the prompt cache's model key: one model here

    def __init__(self, model_path: str, prompt_cache_size: int) -> None:
        from engine_ceiling import Engine

        self.engine = Engine(model_path, DECODE_CONCURRENCY, PROMPT_CONCURRENCY)
        self.tokenizer = self.engine.tokenizer
        self.prompt_cache_size = prompt_cache_size

    def tokenize(self, messages: list[dict[str, str]]) -> tuple[list[int], list, list[str]]:
        """The prompt and its segments as ``mlx_lm.server``'s ``_tokenize`` splits a chat
        request: the system prompt (cached on its own when its prefill ends), the rest.
        (No thinking tail: these prompts end with the assistant header alone.)"""
        tok = self.tokenizer
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        num_system = 0
        for m in messages:
            if m["role"] != "system":
                break
            num_system += 1
        segments: list[list[int]] = []
        types: list[str] = []
        sys_end = 0
        if num_system:
            sys_tokens = tok.apply_chat_template(
                messages[:num_system] + [{"role": "user", "content": ""}],
                add_generation_prompt=False,
                tokenize=True,
            )
            for i, (a, b) in enumerate(zip(sys_tokens, prompt, strict=False)):
                if a != b:
                    sys_end = i
                    break
            if 0 < sys_end < len(prompt):
                segments.append(prompt[:sys_end])
                types.append("system")
        segments.append(prompt[sys_end:])
        types.append("user")
        return prompt, segments, types

    def run(self, w: AgentWorkload, prompts: Prompts, rnd: int) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.models.cache import LRUPromptCache

        engine, tok = self.engine, self.tokenizer
        gen = BatchGenerator(
            engine.model,
            completion_batch_size=DECODE_CONCURRENCY,
            prefill_batch_size=PROMPT_CONCURRENCY,
            stream=engine.stream,
        )
        cache = LRUPromptCache(self.prompt_cache_size)
        convs = [Conversation(prompts.system()) for _ in range(w.sessions)]
        last: dict[int, tuple[TurnRecord, list[int]]] = {}  # session -> its last turn
        live: dict[int, dict[str, Any]] = {}
        records: list[TurnRecord] = []
        t0 = time.perf_counter()

        def submit(session: int, turn: int, start: float) -> None:
            """A turn arrives at ``start`` (run clock): tokenized, its cache looked up
            and inserted, as the server does with a request."""
            rec = TurnRecord(
                "engine",
                rnd,
                w.sessions,
                session,
                turn,
                w.max_tokens_of(session, turn),
                w.user_length(session, turn),
            )
            rec.start_s = start
            messages = convs[session].request(prompts.user(session, turn))
            prompt, segments, types = self.tokenize(messages)
            prompt_cache, rest = cache.fetch_nearest_cache(self.MODEL_KEY, prompt)
            cached = len(prompt) - len(rest)
            skip = cached  # the cached tokens leave the segments, as in _generate
            while skip > 0:
                if skip >= len(segments[0]):
                    skip -= len(segments.pop(0))
                    types.pop(0)
                else:
                    segments[0] = segments[0][skip:]
                    break
            rec.prompt_tokens, rec.cached_tokens = len(prompt), cached
            if session in last:
                prev, prev_tokens = last[session]
                rec.reusable_tokens = reusable_after(prev)
                rec.retokenized_prefix = common_prefix(prev_tokens, prompt)
            (uid,) = gen.insert_segments(
                segments=[segments],
                max_tokens=[rec.max_tokens],
                caches=[prompt_cache],
                all_tokens=[prompt[:cached]],
                stop_sequences=[engine.stop],
            )
            live[uid] = {
                "rec": rec,
                "messages": messages,
                "types": types[::-1],
                "ids": [],
                "times": [],
            }

        pending: list[tuple[float, int, int]] = []  # (due, session, turn): after a tool's time
        with mx.stream(engine.stream):
            start = time.perf_counter() - t0
            for session in range(w.sessions):  # all sessions arrive together
                submit(session, 1, start)
            while live or pending:
                now = time.perf_counter() - t0
                for due, session, turn in sorted(p for p in pending if p[0] <= now):
                    pending.remove((due, session, turn))
                    submit(session, turn, due)
                if not live:
                    time.sleep(max(0.0, min(pending)[0] - now))
                    continue
                prompt_responses, responses = gen.next()
                now = time.perf_counter() - t0
                # the system segment cached when its prefill ends, as _generate does
                ends = [
                    r.uid
                    for r in prompt_responses
                    if r.end_of_segment and not r.end_of_prompt and live[r.uid]["types"]
                ]
                if ends:
                    for uid, (seg_cache, seg_tokens) in gen.extract_cache(ends).items():
                        cache.insert_cache(
                            self.MODEL_KEY,
                            seg_tokens[:],
                            seg_cache,
                            cache_type=live[uid]["types"].pop(),
                        )
                for r in responses:
                    state = live[r.uid]
                    state["ids"].append(r.token)
                    state["times"].append(now)
                    if r.finish_reason is None:
                        continue
                    del live[r.uid]
                    cache.insert_cache(
                        self.MODEL_KEY, r.all_tokens[:], r.prompt_cache, cache_type="assistant"
                    )
                    rec: TurnRecord = state["rec"]
                    ids = state["ids"]
                    rec.completion_tokens = len(ids)
                    rec.finish_reason = r.finish_reason
                    # the stop token is not part of the reply's text
                    text = tok.decode(ids[:-1] if r.finish_reason == "stop" else ids)
                    rec.reply_chars = len(text)
                    rec.finish(state["times"], time.perf_counter() - t0)
                    records.append(rec)
                    convs[rec.session].reply(state["messages"], text)
                    last[rec.session] = (rec, list(r.all_tokens))
                    if rec.turn < w.turns:
                        pause = w.tool_seconds_of(rec.session, rec.turn + 1)
                        if pause:
                            pending.append((rec.end_s + pause, rec.session, rec.turn + 1))
                        else:
                            submit(rec.session, rec.turn + 1, rec.end_s)
            wall = time.perf_counter() - t0
        gen.close()
        gc.collect()
        mx.clear_cache()
        return {"wall_s": wall, "records": records}


# -------------------------------------------------------------------- statistics


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def _fraction(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def summarize(records: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the turns and runs of one system at one sessions level (all rounds)."""
    ok = [r for r in records if r.get("error") is None]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    wall = sum(run["wall_s"] for run in runs)
    first = [r for r in ok if r["turn"] == 1]
    later = [r for r in ok if r["turn"] > 1]

    def ttft(rs: list[dict[str, Any]], q: float) -> float | None:
        return _ms(percentile([r["ttft_s"] for r in rs if r["ttft_s"] is not None], q))

    def cached(rs: list[dict[str, Any]]) -> tuple[int, int]:
        both = [r for r in rs if r["prompt_tokens"] and r["cached_tokens"] is not None]
        return sum(r["cached_tokens"] for r in both), sum(r["prompt_tokens"] for r in both)

    itl = [g for r in ok for g in r.get("itl_s") or ()]
    queued = [r["queued_s"] for r in ok if r.get("queued_s") is not None]
    # seconds each turn streamed, from its first token to its end: over the wall time,
    # the rows decoding at a time on average (more rows, longer steps, wider gaps)
    streaming = sum(r["end_s"] - r["start_s"] - r["ttft_s"] for r in ok
                    if r.get("ttft_s") is not None and r.get("end_s") is not None)
    cached_all, prompt_all = cached(ok)
    cached_later, prompt_later = cached(later)
    reusable = [r for r in later if r.get("reusable_tokens") and r["cached_tokens"] is not None]
    cpu = [run["cpu_s"] for run in runs if run.get("cpu_s") is not None]
    by_turn: dict[str, dict[str, Any]] = {}
    for turn in sorted({r["turn"] for r in ok}):
        rs = [r for r in ok if r["turn"] == turn]
        c, p = cached(rs)
        by_turn[str(turn)] = {
            "turns": len(rs),
            "ttft_p50_ms": ttft(rs, 50),
            "ttft_p99_ms": ttft(rs, 99),
            "prompt_tokens_mean": round(p / len(rs), 1) if rs else None,
            "cached_fraction": _fraction(c, p),
        }
    return {
        "runs": len(runs),
        "turns": len(records),
        "errors": len(records) - len(ok),
        "retries": sum(r.get("retries", 0) for r in records),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "ttft_p50_ms": ttft(ok, 50),
        "ttft_p99_ms": ttft(ok, 99),
        "ttft_turn1_p50_ms": ttft(first, 50),
        "ttft_turn1_p99_ms": ttft(first, 99),
        "ttft_later_p50_ms": ttft(later, 50),
        "ttft_later_p99_ms": ttft(later, 99),
        "itl_p50_ms": _ms(percentile(itl, 50)),
        "itl_p99_ms": _ms(percentile(itl, 99)),
        # ours: the turns' wait for a place in the engine, of their TTFT (access log)
        "queued_p50_ms": _ms(percentile(queued, 50)) if queued else None,
        "queued_p99_ms": _ms(percentile(queued, 99)) if queued else None,
        "decoding_rows_mean": round(streaming / wall, 2) if wall > 0 else None,
        "prompt_tokens": prompt_all,
        "cached_tokens": cached_all,
        "cached_fraction": _fraction(cached_all, prompt_all),
        "cached_fraction_later": _fraction(cached_later, prompt_later),
        # of what the previous turns left reusable, the share a later turn got from the cache
        "reused_of_reusable": _fraction(
            sum(r["cached_tokens"] for r in reusable), sum(r["reusable_tokens"] for r in reusable)
        ),
        "cpu_ms_per_token": round(1000 * sum(cpu) / tokens, 3) if cpu and tokens else None,
        "by_turn": by_turn,
    }


def system_order(runs: list[dict[str, Any]]) -> list[str]:
    """The systems of ``runs``: ours, mlx_lm.server and the engine first, then ours's
    variants (``--variant``) in the order they ran."""
    ran = list(dict.fromkeys(run["system"] for run in runs))
    return [s for s in SYSTEMS if s in ran] + [s for s in ran if s not in SYSTEMS]


def label(system: str) -> str:
    return LABELS.get(system, f"mlx-trio-server {system}")


def color(system: str, systems: list[str]) -> str:
    if system in COLORS:
        return COLORS[system]
    variants = [s for s in systems if s not in COLORS]
    return VARIANT_COLORS[variants.index(system) % len(VARIANT_COLORS)]


def summarize_all(records: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``{sessions: {system: summary}}`` over every run of a results file."""
    out: dict[str, dict[str, Any]] = {}
    for n in sorted({run["sessions"] for run in runs}):
        out[str(n)] = {}
        for system in system_order(runs):
            rs = [run for run in runs if run["sessions"] == n and run["system"] == system]
            if rs:
                recs = [r for r in records if r["sessions"] == n and r["system"] == system]
                out[str(n)][system] = summarize(recs, rs)
    return out


# ---------------------------------------------------------------- table and plot


def _f(v: Any, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def render_table(summary: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'sessions':>8} | {'system':<11} | {'tok/s':>7} | {'TTFT t1 p50/p99 ms':>19} | "
        f"{'TTFT later p50/p99 ms':>21} | {'ITL p50/p99 ms':>15} | {'cached %':>8} | "
        f"{'later %':>7} | {'of reusable %':>13} | {'rows':>5} | errors/retries"
    )
    lines = [header, "-" * len(header)]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}"

    for n in sorted(summary, key=int):
        by = summary[n]
        for system in by:
            s = by[system]

            def pair(key: str, s=s) -> str:
                return f"{_f(s[key + '_p50_ms'], '.1f')}/{_f(s[key + '_p99_ms'], '.1f')}"

            lines.append(
                f"{n:>8} | {system:<11} | {_f(s['tok_s'], '.1f'):>7} | "
                f"{pair('ttft_turn1'):>19} | {pair('ttft_later'):>21} | {pair('itl'):>15} | "
                f"{pct(s['cached_fraction']):>8} | {pct(s['cached_fraction_later']):>7} | "
                f"{pct(s['reused_of_reusable']):>13} | {_f(s.get('decoding_rows_mean'), '.1f'):>5} | "
                f"{s['errors']}/{s.get('retries', 0)}"
            )
        ours = by.get("ours")
        for other in by:
            if ours is None or other == "ours":
                continue
            o = by[other]

            def r(key: str, o=o, ours=ours) -> str:
                return _ratio(ours.get(key), o.get(key))

            lines.append(
                f"{'':>8} | {'ours/' + other:<11} | {r('tok_s'):>7} | "
                f"{r('ttft_turn1_p50_ms') + '/' + r('ttft_turn1_p99_ms'):>19} | "
                f"{r('ttft_later_p50_ms') + '/' + r('ttft_later_p99_ms'):>21} | "
                f"{r('itl_p50_ms') + '/' + r('itl_p99_ms'):>15} | "
                f"{r('cached_fraction'):>8} | {r('cached_fraction_later'):>7} | "
                f"{r('reused_of_reusable'):>13} | {r('decoding_rows_mean'):>5} |"
            )
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(n) for n in summary)
    top = str(max(levels))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax_tok, ax_ttft, ax_turn, ax_cache = axes.flat
    systems = list(dict.fromkeys(s for by in summary.values() for s in by))
    for system in systems:
        xs = [n for n in levels if system in summary[str(n)]]
        if not xs:
            continue
        by = [summary[str(n)][system] for n in xs]
        style = {"color": color(system, systems), "marker": "o"}
        ax_tok.plot(xs, [s["tok_s"] for s in by], label=label(system), **style)
        for key, dash, marker, what in (
            ("ttft_turn1_p50_ms", "-", "o", "turn 1"),
            ("ttft_later_p50_ms", "--", "s", "later turns"),
        ):
            pts = [(n, s[key]) for n, s in zip(xs, by, strict=True) if s[key] is not None]
            if pts:
                ax_ttft.plot(
                    *zip(*pts, strict=True),
                    linestyle=dash,
                    marker=marker,
                    color=color(system, systems),
                    label=f"{label(system)}, {what}",
                )
        turns = summary[top].get(system, {}).get("by_turn", {})
        ts = sorted(int(t) for t in turns)
        pts = [
            (t, turns[str(t)]["ttft_p50_ms"])
            for t in ts
            if turns[str(t)]["ttft_p50_ms"] is not None
        ]
        if pts:
            ax_turn.plot(*zip(*pts, strict=True), label=label(system), **style)
        pts = [
            (t, turns[str(t)]["cached_fraction"])
            for t in ts
            if turns[str(t)]["cached_fraction"] is not None
        ]
        if pts:
            ax_cache.plot(*zip(*pts, strict=True), label=label(system), **style)
    for ax in (ax_tok, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent sessions")
    ax_tok.set_ylabel("generated tokens/s (all sessions)")
    ax_ttft.set_ylabel("TTFT p50 (ms)")
    ax_ttft.set_yscale("log")
    turns = sorted({int(t) for by in summary[top].values() for t in by.get("by_turn", {})})
    for ax in (ax_turn, ax_cache):
        ax.set_xticks(turns, [str(t) for t in turns])
    ax_turn.set_xlabel(f"turn ({top} sessions)")
    ax_turn.set_ylabel("TTFT p50 (ms)")
    ax_turn.set_yscale("log")
    ax_cache.set_xlabel(f"turn ({top} sessions)")
    ax_cache.set_ylabel("cached / prompt tokens")
    ax_cache.set_ylim(-0.02, 1.02)
    if not ax_cache.lines:  # streams closed before their usage chunk (--ask-tokens)
        ax_cache.text(0.5, 0.5, "no usage reported: each stream closed\nwhere its reply ended",
                      ha="center", va="center", transform=ax_cache.transAxes, fontsize=9)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_title(meta: dict[str, Any]) -> str:
    w = meta["workload"]
    u, g = w["user_tokens"], w["max_tokens"]
    tool = w.get("tool_seconds") or (0, 0)
    tools = f", tools {tool[0]:g}-{tool[1]:g} s" if tool[1] else ""
    asked = f" (asking {w['ask_tokens']})" if w.get("ask_tokens") else ""
    return (
        f"{Path(str(meta['model'])).name}: {w['turns']} turns, system {w['system_tokens']} tok, "
        f"user {u[0]}-{u[1]} tok, max_tokens {g[0]}-{g[1]}{asked}{tools}, {meta['rounds']} round(s), "
        f"{meta.get('machine', {}).get('cpus')} CPUs, {meta['timestamp']}"
    )


def show(data: dict[str, Any], out_json: Path, draw: bool) -> None:
    """Print the table of a results file; write its plot next to it."""
    summary = summarize_all(data["records"], data["runs"])
    title = run_title(data["meta"])
    sys.stdout.write(f"{title}\n{render_table(summary)}\n")
    if draw:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            log.warning("no matplotlib: no plot (pip install matplotlib)")
            return
        out_png = out_json.with_suffix(".png")
        plot(summary, out_png, title)
        sys.stdout.write(f"wrote {out_png}\n")


# ----------------------------------------------------------------------- model


def model_window(model: str) -> int | None:
    """The context window the servers see: the config's ``max_position_embeddings``
    or the tokenizer's ``model_max_length``, whichever is smaller."""
    limits = []
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        try:
            value = json.loads((Path(model) / name).read_text()).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(value, int) and 0 < value < 10**12:
            limits.append(value)
    return min(limits) if limits else None


def widen_context(model: Path, tokens: int) -> None:
    """Raise a built model's window (config and tokenizer) to ``tokens``."""
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = model / name
        config = json.loads(path.read_text())
        config[key] = tokens
        path.write_text(json.dumps(config, indent=2) + "\n")


def count_tokens(model: str, text: str) -> int | None:
    """``text``'s length in the model's tokens (None without a ``tokenizer.json``)."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)


def longest_prompt(w: AgentWorkload) -> int:
    """A generous bound on the last turn's prompt (the template adds a few tokens a message)."""
    return w.system_tokens + w.turns * (w.user_tokens[1] + w.max_tokens[1] + 32) + 64


# ------------------------------------------------------------------------- CLI


def _parse_pair(text: str, number: type, lowest: float, form: str) -> tuple:
    """``N`` or ``LO-HI`` as a pair of ``number``s with ``lowest <= LO <= HI``."""
    lo, _, hi = text.partition("-")
    try:
        pair = (number(lo), number(hi or lo))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}") from exc
    if pair[0] < lowest or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"expected {lowest:g} <= LO <= HI, got {text!r}")
    return pair


def parse_range(text: str) -> tuple[int, int]:
    return _parse_pair(text, int, 1, "N or LO-HI")


def parse_seconds(text: str) -> tuple[float, float]:
    return _parse_pair(text, float, 0, "S or LO-HI seconds")


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("comma-separated positive integers")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list of ours, mlx_lm, engine"
    )
    p.add_argument(
        "--sessions",
        type=parse_levels,
        default=None,
        help="concurrent sessions, one run per value (default 1,4,16)",
    )
    p.add_argument("--turns", type=int, default=None, help="turns per session (default 6)")
    p.add_argument(
        "--system-tokens",
        type=int,
        default=None,
        help="S: the shared system prompt's length in tokens (default 12000)",
    )
    p.add_argument(
        "--user-tokens",
        type=parse_range,
        default=None,
        help="U: each new user turn's length, N or LO-HI (default 200-500)",
    )
    p.add_argument(
        "--max-tokens",
        type=parse_range,
        default=None,
        help="G: each reply's max_tokens, N or LO-HI (default 64)",
    )
    p.add_argument(
        "--tool-seconds",
        type=parse_seconds,
        default=(0.0, 0.0),
        help="seconds between a reply and the session's next turn, S or LO-HI (an agent "
        "running a tool; default 0: at once). Sessions whose turns arrive at once are "
        "looked up right after their last turn was stored; with a pause, other sessions' "
        "turns are stored between, as with a real agent's tools",
    )
    p.add_argument(
        "--ask-tokens",
        type=int,
        default=None,
        help="A: HTTP systems ask for max_tokens A in every request, as agents do (Claude "
        "Code: 64000), and close the stream after G tokens' chunks, where the reply would "
        "have ended (default: ask for G)",
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds of all systems (default 2)")
    p.add_argument("--warm-up-pass", action=argparse.BooleanOptionalAction, default=True,
                   help="before the first round, run each level once unmeasured so that the "
                   "GPU's kernels for its shapes are built (see warm_up_pass)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra flags for ours, one string")
    p.add_argument(
        "--probe-dir",
        default=None,
        help="give each server of ours an engine step trace (MLX_TRIO_ENGINE_PROBE) in "
        "DIR, named SYSTEM-rROUND-nSESSIONS.PID, for bench/trace_summary.py",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME[@TREE]=FLAGS",
        help="another configuration of ours, run as system NAME with --server-args and "
        "FLAGS (e.g. 'no-reuse=--decode-row-reuse-steps 0'; leading VARIABLE=VALUE words "
        "go to its environment), from the source tree TREE if "
        "given (another build's checkout), alternated with the systems in each round; "
        "ratios of ours to it are printed as to the others",
    )
    p.add_argument("--mlx-lm-args", default="", help="extra flags for mlx_lm.server, one string")
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=None,
        help="--prompt-cache-size for both servers and the engine's LRUPromptCache "
        f"(default: each one's default: ours 64, mlx_lm.server's {DEFAULT_PROMPT_CACHE_SIZE}, "
        f"the engine {DEFAULT_PROMPT_CACHE_SIZE})",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results JSON (default bench/results/agent-sessions-<timestamp>.json)",
    )
    p.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    p.add_argument(
        "--plot-only",
        metavar="JSON",
        default=None,
        help="print the table and draw the plot of a saved results JSON, then exit",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke run: tiny model, S=1500, U=60-120, G=16, 3 turns, sessions 1,4, 1 round",
    )
    ns = p.parse_args(argv)
    shape = QUICK if ns.quick else DEFAULTS
    for key, value in shape.items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    ns.systems = [s.strip() for s in ns.systems.split(",") if s.strip()]
    unknown = set(ns.systems) - set(SYSTEMS)
    if unknown or not ns.systems:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    ns.systems = [s for s in SYSTEMS if s in ns.systems]  # the alternation's order
    ns.variants = {}
    for spec in ns.variant:
        name, sep, flags = spec.partition("=")
        name, _, tree = name.strip().partition("@")
        if not sep or not name or name in SYSTEMS or name in ns.variants:
            p.error(f"--variant {spec!r}: want NAME[@TREE]=FLAGS, NAME new, not one of {SYSTEMS}")
        if tree and not (Path(tree) / "api" / "cli.py").is_file():
            p.error(f"--variant {spec!r}: {tree} holds no api/cli.py")
        environment, words = variant_environment(flags)
        ns.variants[name] = (Path(tree).resolve() if tree else REPO, shlex.join(words),
                             environment)
    ns.systems += list(ns.variants)
    return ns


def warm_up_workload(w: AgentWorkload) -> AgentWorkload:
    """A short session of the same kind: kernels built, first-call costs paid."""
    return replace(
        w,
        sessions=1,
        turns=2,
        system_tokens=min(w.system_tokens, 512),
        user_tokens=(w.user_tokens[0],) * 2,
        max_tokens=(min(8, w.max_tokens[0]),) * 2,
        seed=w.seed + 1000,
        system_lead=WARM_UP_LEAD,
        tool_seconds=(0.0, 0.0),
    )


def server_command(system: str, model: str, port: int, ns: argparse.Namespace) -> list[str]:
    variant = ns.variants.get(system)
    argv = server_argv(SERVER_KIND["ours" if variant is not None else system], model, port)
    if ns.prompt_cache_size is not None:
        argv += ["--prompt-cache-size", str(ns.prompt_cache_size)]
    if system == "mlx_lm":
        return argv + shlex.split(ns.mlx_lm_args)
    return argv + shlex.split(ns.server_args) + shlex.split(variant[1] if variant else "")


def warm_up_pass(w, builder, warm, ns, model, log_dir, stamp) -> None:
    """An unmeasured run of this level's shapes (two turns, other prompts), on a server.

    mlx's CUDA backend compiles kernels per kernel and shape the first time any
    process needs them and keeps them on disk (``MLX_PTX_CACHE_DIR``): on a fresh
    machine whichever system meets a shape first pays for it, and the first system
    of a round is always the same one. Ours runs it (its kernels include mlx-lm's),
    so every measured system finds the level's kernels built."""
    system = next((s for s in ns.systems if s != "engine"), None)
    if system is None:
        return
    probe = replace(w, turns=min(2, w.turns), seed=w.seed + 7919)
    progress(f"warm-up pass, {w.sessions} sessions: {system}")
    run_server(system, model, probe, Prompts(builder, probe), warm, -1, ns, log_dir, stamp)


ACCESS_QUEUED = re.compile(r"mlx_trio\.access: request_id=(\S+) .*\bqueued_ms=([\d.]+)")


def access_queued(log_path: Path) -> dict[str, float]:
    """Each request's ``queued_ms`` in a server's log, in seconds, by request id (the
    last line of an id: a warm-up's turn can share a measured one's)."""
    queued: dict[str, float] = {}
    if log_path.exists():
        for line in log_path.read_text(errors="replace").splitlines():
            match = ACCESS_QUEUED.search(line)
            if match:
                queued[match.group(1)] = float(match.group(2)) / 1000
    return queued


def run_server(
    system: str,
    model: str,
    w: AgentWorkload,
    prompts: Prompts,
    warm: Prompts,
    rnd: int,
    ns: argparse.Namespace,
    log_dir: Path,
    stamp: str,
) -> dict[str, Any]:
    """A fresh server: started, warmed up with a short session, measured, stopped."""
    port = free_port()
    argv = server_command(system, model, port, ns)
    server = ServerProcess(
        label(system),
        argv,
        f"http://127.0.0.1:{port}",
        log_dir / f"agent-{stamp}-{system}-r{rnd}-n{w.sessions}.log",
    )
    probe = None
    if ns.probe_dir and SERVER_KIND.get(system) != "ref":
        probe = str(Path(ns.probe_dir) / f"{system}-r{rnd}-n{w.sessions}")
        Path(ns.probe_dir).mkdir(parents=True, exist_ok=True)
    # ``python -m api.cli`` from the repository root (a variant's own tree)
    tree, _, environment = ns.variants.get(system, (REPO, "", {}))
    environment = {**environment, **({PROBE_ENV: probe} if probe else {})}
    server.start(cwd=tree, env=environment or None)
    try:
        startup = server.wait_healthy()
        t = time.perf_counter()
        warm_run = run_http(server.url, warm.w, warm, system, rnd)
        errors = [r.error for r in warm_run["records"] if r.error]
        if errors:
            raise RuntimeError(f"{system}: warm-up failed: {errors[0]}")
        warm_s = time.perf_counter() - t
        run = run_http(server.url, w, prompts, system, rnd, server.pid)
    finally:
        rc = server.stop()
    queued = access_queued(server.log_path)
    for rec in run["records"]:
        rec.queued_s = queued.get(turn_request_id(rec))
    run.update(
        startup_s=round(startup, 2),
        warm_up_s=round(warm_s, 2),
        exit_code=rc,
        command=argv,
        probe=probe,  # its engine's step trace: PROBE.PID (bench/trace_summary.py)
    )
    return run


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    _setup_logging()
    if ns.plot_only:
        path = Path(ns.plot_only)
        show(json.loads(path.read_text()), path, draw=True)
        return 0
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_json = Path(ns.out) if ns.out else BENCH / "results" / f"agent-sessions-{stamp}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    log_dir = BENCH / "results" / "logs"

    tmp_model = None
    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        tmp_model = tempfile.mkdtemp(prefix="bench-agent-model-")
        progress(f"building the tiny model in {tmp_model}")
        built = build_tiny_model(tmp_model)
        widen_context(built, TINY_CONTEXT)
        model = str(built)
    base = AgentWorkload(
        turns=ns.turns,
        system_tokens=ns.system_tokens,
        user_tokens=tuple(ns.user_tokens),
        max_tokens=tuple(ns.max_tokens),
        seed=ns.seed,
        tool_seconds=tuple(ns.tool_seconds),
        ask_tokens=ns.ask_tokens,
    )
    window = model_window(model)
    if window is not None and longest_prompt(base) > window:
        log.warning(
            "the last turns may need up to %d tokens, past the model's window of %d: "
            "ours answers 400 context_length_exceeded (make_shaped_model.py --context)",
            longest_prompt(base),
            window,
        )
    builder = PromptBuilder(model)
    warm = Prompts(builder, warm_up_workload(base))
    cache_size = ns.prompt_cache_size or DEFAULT_PROMPT_CACHE_SIZE
    meta: dict[str, Any] = {
        "timestamp": stamp,
        "argv": [sys.executable, *sys.argv] if argv is None else argv,
        "model": ns.model or "tiny",
        "model_path": model,
        "model_config": json.loads((Path(model) / "config.json").read_text()),
        "model_window": window,
        "workload": {**asdict(base), "sessions": ns.sessions},
        "systems": ns.systems,
        "rounds": ns.rounds,
        "commands": {s: server_command(s, model, 0, ns) for s in ns.systems if s != "engine"},
        "variants": {name: {"tree": str(tree), "flags": flags, "environment": environment}
                     for name, (tree, flags, environment) in ns.variants.items()},
        "engine": {
            "decode_concurrency": DECODE_CONCURRENCY,
            "prompt_concurrency": PROMPT_CONCURRENCY,
            "prompt_cache_size": cache_size,
            "sampler": "greedy",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": versions(),
    }
    meta["system_tokens_actual"] = count_tokens(model, Prompts(builder, base).system())

    engine: EngineSessions | None = None
    records: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    try:
        for rnd in range(ns.rounds):
            for n in ns.sessions:
                w = replace(base, sessions=n)
                prompts = Prompts(builder, w)
                if rnd == 0 and ns.warm_up_pass:
                    warm_up_pass(w, builder, warm, ns, model, log_dir, stamp)
                for system in ns.systems:
                    progress(f"round {rnd + 1}/{ns.rounds}, {n} sessions: {system}")
                    if system == "engine":
                        if engine is None:
                            engine = EngineSessions(model, cache_size)
                        t = time.perf_counter()
                        engine.run(warm.w, warm, rnd)
                        warm_s = time.perf_counter() - t
                        run = engine.run(w, prompts, rnd)
                        run["warm_up_s"] = round(warm_s, 2)
                    else:
                        run = run_server(system, model, w, prompts, warm, rnd, ns, log_dir, stamp)
                    recs = [
                        asdict(r)
                        for r in sorted(run.pop("records"), key=lambda r: (r.session, r.turn))
                    ]
                    tokens = sum(r["completion_tokens"] or 0 for r in recs)
                    run.update(
                        system=system,
                        round=rnd,
                        sessions=n,
                        turns=len(recs),
                        completion_tokens=tokens,
                        errors=sum(r["error"] is not None for r in recs),
                    )
                    records.extend(recs)
                    runs.append(run)
                    # Each run is kept as it ends: a run cut short keeps the others.
                    partial = {"meta": {**meta, "partial": True}, "runs": runs, "records": records}
                    out_json.write_text(json.dumps(partial, indent=1) + "\n")
                    s = summarize(recs, [run])
                    progress(
                        f"  {system}: {s['tok_s']} tok/s, TTFT p50 turn 1 "
                        f"{s['ttft_turn1_p50_ms']} ms, later {s['ttft_later_p50_ms']} ms, "
                        f"cached {s['cached_fraction']}, errors {s['errors']}"
                    )
    finally:
        if tmp_model is not None:
            shutil.rmtree(tmp_model, ignore_errors=True)
    meta["wall_s"] = round(time.perf_counter() - t_all, 1)
    data = {"meta": meta, "runs": runs, "records": records, "summary": summarize_all(records, runs)}
    out_json.write_text(json.dumps(data, indent=1) + "\n")
    show(data, out_json, draw=ns.plot)
    sys.stdout.write(f"wrote {out_json}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
