"""Agent sessions through nginx in front of N replicas: session affinity against round robin.

The workload of ``agent_sessions.py`` (N concurrent sessions of T turns over one
shared system prompt, each turn the whole conversation so far plus a new user
turn; its ``AgentWorkload``, ``Prompts``, ``Conversation``, ``TurnRecord`` and
its streaming client, by import) is sent to nginx (Debian's package) in front
of ``--replicas`` fresh mlx-trio-server processes, in two modes:

* ``affinity``: the upstream hashes the session header with ``hash $key
  consistent``, so every turn of a session goes to the replica whose prompt
  cache holds its previous turn (the configuration of docs/scaling.md, written
  by ``nginx_config``);
* ``round_robin``: the same nginx and replicas with a plain upstream (nginx's
  default, round robin), so a session's turns go wherever the rotation is.

Each session sends its id in one header (``--session-header``, by default
Claude Code's ``X-Claude-Code-Session-Id``), as the agents do. Per mode and
round the replicas are fresh processes (cold prompt caches), each first warmed
up directly (not through nginx) with a short session of its own, not counted.
nginx adds ``X-Upstream: $upstream_addr`` to every answer, so each turn records
the replica that answered it.

One row per mode: tokens/s, TTFT of turn 1 and of later turns, the cached
fraction (``usage.prompt_tokens_details.cached_tokens`` over the prompt tokens,
all turns and turns 2 and on), the share of what the previous turn left
reusable that a later turn got from the cache, the prompt tokens the replicas
computed (prefilled: prompt minus cached tokens, all turns), the replicas a
session's turns went to (1.0: every session stayed on one), the turns each
replica served (most first: how even the hash spread the sessions), and errors.

    .venv/bin/python bench/affinity.py --quick                # CPU smoke run, tiny model
    .venv/bin/python bench/affinity.py --model DIR --replicas 3 --sessions 12 --turns 8 \\
        --system-tokens 12000 --user-tokens 200-500 --max-tokens 64 --gpu-per-replica

nginx comes from Debian: ``apt-get install -y nginx`` (the program stops with
that hint when it is missing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # runtime.tiny_model when the package is not installed

from agent_sessions import (  # noqa: E402
    TINY_CONTEXT,
    AgentWorkload,
    Conversation,
    Prompts,
    TurnRecord,
    _http_turn,
    parse_range,
    reusable_after,
    run_http,
    summarize,
    warm_up_workload,
    widen_context,
)
from loadgen import PromptBuilder, ServerProcess, progress_reporter  # noqa: E402
from loadgen import setup_logging as _setup_logging  # noqa: E402
from side_by_side import free_port, server_argv, versions  # noqa: E402

log = logging.getLogger("bench.affinity")


progress = progress_reporter(log)

MODES = ("affinity", "round_robin")
# The headers that carry a session id, in the order nginx's maps look for them:
# Claude Code's, Codex's, and the one documented for any other client.
SESSION_HEADERS = ("X-Claude-Code-Session-Id", "session-id", "x-session-id")
NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")
# The replicas' request-body limit (--max-request-bytes' default): nginx takes as
# much, and keeps a body of that size in memory, so a retry resends it as it came.
MAX_BODY = "8m"
# Hypercorn closes an idle connection after 5 s; nginx drops its idle upstream
# connections first, so it never sends a request on one the replica is closing.
UPSTREAM_KEEPALIVE_TIMEOUT = "4s"

DEFAULTS = {
    "sessions": 12,
    "turns": 6,
    "system_tokens": 12000,
    "user_tokens": (200, 500),
    "max_tokens": (64, 64),
    "rounds": 2,
}
QUICK = {
    "sessions": 9,
    "turns": 4,
    "system_tokens": 1000,
    "user_tokens": (150, 250),
    "max_tokens": (16, 16),
    "rounds": 1,
}


# ------------------------------------------------------------------- nginx


def nginx_config(
    *,
    listen: str,
    replicas: list[str],
    prefix: str,
    affinity: bool = True,
    user: str | None = "www-data",
) -> str:
    """nginx's whole configuration: ``listen`` (``8080`` or ``127.0.0.1:8080``) in
    front of ``replicas`` (``host:port`` each), every file nginx writes under
    ``prefix``. ``affinity``: hash the session key (consistent hashing); otherwise
    a plain upstream (round robin). ``user``: the workers' user when nginx starts
    as root (None: nginx's default). docs/scaling.md shows the output for three
    replicas; tests/test_scaling_nginx.py checks that it does and runs it."""
    p = prefix.rstrip("/")
    balance = (
        [
            "        # Consistent hashing (ketama) on the session key: a session goes to",
            "        # one replica; when a replica leaves, only its sessions move.",
            "        hash $mlx_session_key consistent;",
        ]
        if affinity
        else ["        # No hash: round robin, each request to the next replica."]
    )
    servers = [f"        server {r} max_fails=1 fail_timeout=10s;" for r in replicas]
    lines = [
        "# nginx in front of mlx-trio-server replicas: every request of a session goes",
        "# to the replica whose prompt cache holds the session's prefix, and a dead",
        "# replica's sessions move to the others.",
        *([f"user {user};"] if user else []),
        "worker_processes 1;",
        f"pid {p}/nginx.pid;",
        f"error_log {p}/error.log notice;",
        "",
        "events {",
        "    worker_connections 1024;",
        "}",
        "",
        "http {",
        "    # Every file nginx writes stays under one folder.",
        f"    client_body_temp_path {p}/client_body_temp;",
        f"    proxy_temp_path {p}/proxy_temp;",
        f"    fastcgi_temp_path {p}/fastcgi_temp;",
        f"    uwsgi_temp_path {p}/uwsgi_temp;",
        f"    scgi_temp_path {p}/scgi_temp;",
        "    # One line a request: its session headers, the replicas tried and their answers.",
        "    log_format replicas '$time_iso8601 $remote_addr \"$request\" $status '",
        "                        'claude=$http_x_claude_code_session_id codex=$http_session_id '",
        "                        'other=$http_x_session_id upstream=\"$upstream_addr\" '",
        "                        'upstream_status=\"$upstream_status\" request_time=$request_time';",
        f"    access_log {p}/access.log replicas;",
        "",
        "    # The session key: the first of these headers that the request carries",
        "    # (Claude Code's, Codex's, ours for any other client), else the client's",
        "    # address. Each map falls back to the one before it.",
        "    map $http_x_session_id $mlx_session_other {",
        '        ""      $binary_remote_addr;',
        "        default $http_x_session_id;",
        "    }",
        "    map $http_session_id $mlx_session_codex {",
        '        ""      $mlx_session_other;',
        "        default $http_session_id;",
        "    }",
        "    map $http_x_claude_code_session_id $mlx_session_key {",
        '        ""      $mlx_session_codex;',
        "        default $http_x_claude_code_session_id;",
        "    }",
        "",
        "    upstream mlx_trio {",
        *balance,
        "        # One failed attempt (refused, timed out, 502, 503) takes a replica",
        "        # out for 10 s; then one request tries it again.",
        *servers,
        "        # Idle connections kept open to the replicas (HTTP/1.1 keep-alive),",
        "        # closed before Hypercorn's own 5 s keep-alive timeout closes them.",
        "        keepalive 32;",
        f"        keepalive_timeout {UPSTREAM_KEEPALIVE_TIMEOUT};",
        "    }",
        "",
        "    server {",
        f"        listen {listen};",
        "        # The replicas' --max-request-bytes; a body is kept in memory so that",
        "        # a retry on another replica resends it.",
        f"        client_max_body_size {MAX_BODY};",
        f"        client_body_buffer_size {MAX_BODY};",
        "",
        "        location / {",
        "            proxy_pass http://mlx_trio;",
        "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        "            proxy_set_header Host $host;",
        "            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "",
        "            # Streams: each chunk passed on as it comes. A non-streaming",
        "            # request sends nothing until its answer is done, so the read",
        "            # timeout covers the longest prefill plus generation.",
        "            proxy_buffering off;",
        "            proxy_read_timeout 3600s;",
        "            proxy_send_timeout 3600s;",
        "            proxy_connect_timeout 2s;",
        "",
        "            # Failover: a refused or reset connection, a timeout, or a 502/503",
        "            # (engine restarting, server shutting down) before any byte went",
        "            # to the client is sent to the next replica on the ring.",
        "            # non_idempotent: POSTs too (a generation changes nothing).",
        "            proxy_next_upstream error timeout http_502 http_503 non_idempotent;",
        f"            proxy_next_upstream_tries {len(replicas)};",
        "",
        "            # Which replica answered (after a retry: the list, the last answered).",
        "            add_header X-Upstream $upstream_addr always;",
        "        }",
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def find_nginx() -> str | None:
    for path in (shutil.which("nginx"), *NGINX_PATHS):
        if path and os.access(path, os.X_OK):
            return path
    return None


def worker_user() -> str | None:
    """The workers' user for a configuration under a private temporary folder: as
    root, root (nginx's default, ``nobody``, could not reach a folder under
    ``/tmp/pytest-of-root``); otherwise none (the ``user`` directive needs root)."""
    return "root" if os.geteuid() == 0 else None


def nginx_argv(nginx: str, prefix: Path) -> list[str]:
    """nginx in the foreground on ``prefix/nginx.conf`` (``-e``: its start-up errors
    go to the prefix too, not to /var/log/nginx)."""
    return [
        nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
        "-e", str(prefix / "error.log"), "-g", "daemon off;",
    ]


class Nginx:
    """An nginx master process in the foreground (``daemon off``), ours to stop."""

    def __init__(self, nginx: str, prefix: Path, config: str, port: int) -> None:
        self.prefix, self.port = prefix, port
        prefix.mkdir(parents=True, exist_ok=True)
        (prefix / "nginx.conf").write_text(config)
        self.argv = nginx_argv(nginx, prefix)
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start it and wait (bounded) until ``/health`` answers 200 through it."""
        import httpx

        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nginx did not start:\n{self.error_log()}")
            time.sleep(0.05)

    def error_log(self, n: int = 30) -> str:
        try:
            lines = (self.prefix / "error.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """Fast shutdown (SIGTERM to the master stops its workers too)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def answered_by(x_upstream: str | None) -> str | None:
    """The replica that answered, from ``X-Upstream`` (after a retry nginx lists
    every address it tried: the last one answered)."""
    if not x_upstream:
        return None
    return x_upstream.split(",")[-1].strip() or None


# ------------------------------------------------------------------ sessions


@dataclass
class AffinityTurn(TurnRecord):
    """A turn, and the replica that answered it."""

    mode: str = ""
    replica: str | None = None


async def _run_sessions(
    url: str, w: AgentWorkload, prompts: Prompts, mode: str, rnd: int, header: str
) -> dict[str, Any]:
    """Every session on its own connection with its own session header (as agents
    send), each turn sent as soon as the last one's reply is in (closed loop)."""
    import httpx
    import trio

    timeout = httpx.Timeout(1800.0, connect=30.0)
    records: list[AffinityTurn] = []

    async def session_task(session: int, t0: float) -> None:
        # Ids as agents make them (a UUID), one per session, mode and round.
        sid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"affinity/{w.seed}/{mode}/{rnd}/{session}"))
        current: list[AffinityTurn] = []

        async def note_replica(response: httpx.Response) -> None:
            current[-1].replica = answered_by(response.headers.get("x-upstream"))

        conv = Conversation(prompts.system())
        prev: AffinityTurn | None = None
        async with httpx.AsyncClient(
            base_url=url, headers={header: sid}, timeout=timeout,
            event_hooks={"response": [note_replica]},
        ) as client:
            for turn in range(1, w.turns + 1):
                rec = AffinityTurn(
                    mode, rnd, w.sessions, session, turn,
                    w.max_tokens_of(session, turn), w.user_length(session, turn), mode=mode,
                )
                current.append(rec)
                messages = conv.request(prompts.user(session, turn))
                rec.reusable_tokens = reusable_after(prev)
                rec.start_s = time.perf_counter() - t0
                reply = await _http_turn(client, messages, rec, t0)
                records.append(rec)
                if rec.error is not None:
                    log.warning("%s session %d turn %d: %s", mode, session, turn, rec.error)
                    return  # the session cannot go on without its reply
                conv.reply(messages, reply)
                prev = rec

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for session in range(w.sessions):
            nursery.start_soon(session_task, session, t0)
    return {"wall_s": time.perf_counter() - t0, "records": records}


def run_sessions(
    url: str, w: AgentWorkload, prompts: Prompts, mode: str, rnd: int, header: str
) -> dict[str, Any]:
    import trio

    return trio.run(_run_sessions, url, w, prompts, mode, rnd, header)


# ------------------------------------------------------------------ one run


def replica_command(model: str, port: int, ns: argparse.Namespace) -> list[str]:
    argv = server_argv("ours", model, port)
    if ns.prompt_cache_size is not None:
        argv += ["--prompt-cache-size", str(ns.prompt_cache_size)]
    return argv + shlex.split(ns.server_args)


def run_mode(
    mode: str,
    nginx: str,
    model: str,
    w: AgentWorkload,
    prompts: Prompts,
    warm: Prompts,
    rnd: int,
    ns: argparse.Namespace,
    log_dir: Path,
    stamp: str,
) -> dict[str, Any]:
    """Fresh replicas and an nginx in ``mode``: started, the replicas warmed up
    one by one, the sessions run through nginx, everything stopped."""
    servers = []
    for i in range(ns.replicas):
        port = free_port()
        servers.append(ServerProcess(
            f"replica {i}", replica_command(model, port, ns), f"http://127.0.0.1:{port}",
            log_dir / f"affinity-{stamp}-{mode}-r{rnd}-replica{i}.log",
        ))
    prefix = Path(tempfile.mkdtemp(prefix=f"bench-affinity-nginx-{mode}-"))
    port = free_port()
    config = nginx_config(
        listen=f"127.0.0.1:{port}",
        replicas=[s.url.removeprefix("http://") for s in servers],
        prefix=str(prefix),
        affinity=mode == "affinity",
        user=worker_user(),
    )
    proxy = Nginx(nginx, prefix, config, port)
    try:
        for i, server in enumerate(servers):
            env = {"CUDA_VISIBLE_DEVICES": str(i)} if ns.gpu_per_replica else None
            server.start(cwd=REPO, env=env)  # ``python -m api.cli`` from the repository root
        startup = max(server.wait_healthy() for server in servers)
        t = time.perf_counter()
        for server in servers:
            errors = [r.error for r in run_http(server.url, warm.w, warm, "warm", rnd)["records"]
                      if r.error]
            if errors:
                raise RuntimeError(f"{server.name}: warm-up failed: {errors[0]}")
        warm_s = time.perf_counter() - t
        proxy.start()
        run = run_sessions(proxy.url, w, prompts, mode, rnd, ns.session_header)
    finally:
        proxy.stop()
        if (prefix / "access.log").exists():  # which replica served which session's turns
            shutil.copy(prefix / "access.log", log_dir / f"affinity-{stamp}-{mode}-r{rnd}-nginx.log")
        shutil.rmtree(prefix, ignore_errors=True)
        for server in servers:
            server.stop()
    run.update(
        startup_s=round(startup, 2), warm_up_s=round(warm_s, 2), nginx_config=config,
        replica_commands=[s.argv for s in servers],
    )
    return run


# -------------------------------------------------------------------- report


def placement(records: list[dict[str, Any]], replicas: int) -> dict[str, Any]:
    """Where the turns went: replicas per session (mean, max) and the turns each
    replica served, most first (a replica that served none counts as 0)."""
    by_session: dict[tuple[int, int], set[str]] = {}
    for r in records:
        if r.get("replica"):
            by_session.setdefault((r["round"], r["session"]), set()).add(r["replica"])
    per_session = [len(v) for v in by_session.values()]
    turns = Counter(r["replica"] for r in records if r.get("replica"))
    served = sorted(turns.values(), reverse=True)
    return {
        "replicas_per_session": round(sum(per_session) / len(per_session), 2)
        if per_session else None,
        "replicas_per_session_max": max(per_session, default=None),
        "turns_per_replica": served + [0] * (replicas - len(served)),
        "turns_by_replica": dict(turns),
    }


def summarize_modes(
    records: list[dict[str, Any]], runs: list[dict[str, Any]], replicas: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        rs = [run for run in runs if run["mode"] == mode]
        if rs:
            recs = [r for r in records if r["mode"] == mode]
            out[mode] = {**summarize(recs, rs), **placement(recs, replicas)}
    return out


def render_table(summary: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}"

    header = (
        f"{'mode':<11} | {'tok/s':>6} | {'TTFT t1 p50 ms':>14} | {'TTFT later p50/p99 ms':>21} | "
        f"{'cached %':>8} | {'later %':>7} | {'of reusable %':>13} | {'prefilled tok':>13} | "
        f"{'replicas/session':>16} | {'turns/replica':>13} | errors"
    )
    lines = [header, "-" * len(header)]
    for mode in (m for m in MODES if m in summary):
        s = summary[mode]
        later = f"{f(s['ttft_later_p50_ms'])}/{f(s['ttft_later_p99_ms'])}"
        lines.append(
            f"{mode:<11} | {f(s['tok_s']):>6} | {f(s['ttft_turn1_p50_ms']):>14} | {later:>21} | "
            f"{pct(s['cached_fraction']):>8} | {pct(s['cached_fraction_later']):>7} | "
            f"{pct(s['reused_of_reusable']):>13} | {s['prompt_tokens'] - s['cached_tokens']:>13} | "
            f"{f(s['replicas_per_session'], '.2f'):>16} | "
            f"{'/'.join(map(str, s['turns_per_replica'])):>13} | {s['errors']}"
        )
    return "\n".join(lines)


def run_title(meta: dict[str, Any]) -> str:
    w = meta["workload"]
    u, g = w["user_tokens"], w["max_tokens"]
    return (
        f"{Path(str(meta['model'])).name}: {meta['replicas']} replicas behind nginx, "
        f"{w['sessions']} sessions x {w['turns']} turns, system {w['system_tokens']} tok, "
        f"user {u[0]}-{u[1]} tok, max_tokens {g[0]}-{g[1]}, {meta['rounds']} round(s), "
        f"header {meta['session_header']}, {meta['machine']['cpus']} CPUs, {meta['timestamp']}"
    )


# ----------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    p.add_argument("--replicas", type=int, default=3, help="servers behind nginx (default 3)")
    p.add_argument("--sessions", type=int, default=None, help="concurrent sessions (default 12)")
    p.add_argument("--turns", type=int, default=None, help="turns per session (default 6)")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="the shared system prompt's length in tokens (default 12000)")
    p.add_argument("--user-tokens", type=parse_range, default=None,
                   help="each new user turn's length, N or LO-HI (default 200-500)")
    p.add_argument("--max-tokens", type=parse_range, default=None,
                   help="each reply's max_tokens, N or LO-HI (default 64)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of both modes (default 2)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of affinity, round_robin")
    p.add_argument("--session-header", default=SESSION_HEADERS[0], choices=SESSION_HEADERS,
                   help="the header each session sends its id in (default Claude Code's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra flags for every replica, one string")
    p.add_argument("--prompt-cache-size", type=int, default=None,
                   help="--prompt-cache-size of every replica (default: theirs, 10)")
    p.add_argument("--gpu-per-replica", action="store_true",
                   help="replica i sees GPU i alone (CUDA_VISIBLE_DEVICES=i)")
    p.add_argument("--nginx", default=None, help="the nginx binary (default: found on PATH)")
    p.add_argument("--out", default=None,
                   help="results JSON (default bench/results/affinity-<timestamp>.json)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: tiny model, 9 sessions x 4 turns, S=1000, U=150-250, "
                   "G=16, 1 round")
    ns = p.parse_args(argv)
    shape = QUICK if ns.quick else DEFAULTS
    for key, value in shape.items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    ns.modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    if not ns.modes or set(ns.modes) - set(MODES):
        p.error(f"--modes: choose from {MODES}")
    ns.modes = [m for m in MODES if m in ns.modes]
    if ns.replicas < 1 or ns.sessions < 1 or ns.turns < 1:
        p.error("--replicas, --sessions and --turns must be positive")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    _setup_logging()
    nginx = ns.nginx or find_nginx()
    if nginx is None:
        sys.stderr.write("no nginx: apt-get install -y nginx (Debian's package)\n")
        return 2
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_json = Path(ns.out) if ns.out else BENCH / "results" / f"affinity-{stamp}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    log_dir = BENCH / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    tmp_model = None
    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        tmp_model = tempfile.mkdtemp(prefix="bench-affinity-model-")
        progress(f"building the tiny model in {tmp_model}")
        built = build_tiny_model(tmp_model)
        widen_context(built, TINY_CONTEXT)
        model = str(built)
    w = AgentWorkload(
        sessions=ns.sessions,
        turns=ns.turns,
        system_tokens=ns.system_tokens,
        user_tokens=tuple(ns.user_tokens),
        max_tokens=tuple(ns.max_tokens),
        seed=ns.seed,
    )
    builder = PromptBuilder(model)
    prompts = Prompts(builder, w)
    warm = Prompts(builder, warm_up_workload(w))
    meta: dict[str, Any] = {
        "timestamp": stamp,
        "argv": [sys.executable, *sys.argv] if argv is None else argv,
        "model": ns.model or "tiny",
        "model_path": model,
        "replicas": ns.replicas,
        "workload": asdict(w),
        "modes": ns.modes,
        "rounds": ns.rounds,
        "session_header": ns.session_header,
        "replica_command": replica_command(model, 0, ns),
        "nginx": subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": versions(),
    }
    records: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    try:
        for rnd in range(ns.rounds):
            # Alternate which mode goes first, round by round.
            for mode in ns.modes if rnd % 2 == 0 else ns.modes[::-1]:
                progress(f"round {rnd + 1}/{ns.rounds}: {mode}, {ns.replicas} replicas")
                run = run_mode(mode, nginx, model, w, prompts, warm, rnd, ns, log_dir, stamp)
                recs = [asdict(r) for r in sorted(run.pop("records"),
                                                  key=lambda r: (r.session, r.turn))]
                run.update(mode=mode, round=rnd, sessions=w.sessions, turns=len(recs),
                           errors=sum(r["error"] is not None for r in recs))
                records.extend(recs)
                runs.append(run)
                partial = {"meta": {**meta, "partial": True}, "runs": runs, "records": records}
                out_json.write_text(json.dumps(partial, indent=1) + "\n")
                s = summarize_modes(recs, [run], ns.replicas)[mode]
                progress(
                    f"  {mode}: cached {s['cached_fraction']}, later {s['cached_fraction_later']}, "
                    f"TTFT later p50 {s['ttft_later_p50_ms']} ms, "
                    f"replicas/session {s['replicas_per_session']}, errors {s['errors']}"
                )
    finally:
        if tmp_model is not None:
            shutil.rmtree(tmp_model, ignore_errors=True)
    meta["wall_s"] = round(time.perf_counter() - t_all, 1)
    summary = summarize_modes(records, runs, ns.replicas)
    data = {"meta": meta, "runs": runs, "records": records, "summary": summary}
    out_json.write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(f"{run_title(meta)}\n{render_table(summary)}\nwrote {out_json}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
