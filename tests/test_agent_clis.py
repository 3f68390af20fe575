"""Real coding-agent CLIs against a real server: Claude Code (Anthropic Messages), Codex
(Responses) and opencode (Chat Completions).

Each test installs the CLI from npm into a cache folder (once), starts the
server on loopback with a scripted model (tests/scripted_model.py) whose
greedy output is a call of one of that client's own tools, runs the client
non-interactively in a scratch folder holding ``hello.txt``, and checks
that our server answered its requests, that the client ran the tool (the
file's text came back to us: the model answers only once a tool result is
in the conversation) and that the session ended cleanly.

Skipped, with the reason, where npm is missing or cannot install the CLI.
``AGENT_CLI_CACHE`` overrides the cache folder.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess

import httpx
import pytest

from tests.scripted_model import build_scripted_model
from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = pytest.mark.server  # starts a hypercorn subprocess and the agent CLIs

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"
OPENCODE = "opencode-ai@1.18.33"
ANSWER = "The file says hello."
MARKER = "hello from mlx-trio 7f3a"  # the file's text: seen by us only if the tool ran


def _cli_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "mlx-trio-server" / "agent-clis"
    return pathlib.Path(os.environ.get("AGENT_CLI_CACHE", default))


def install_cli(package: str, binary: str) -> pathlib.Path:
    """The CLI's executable, installed with npm if needed; skips the test when it cannot be."""
    folder = _cli_dir() / package.replace("/", "+")
    exe = folder / "node_modules" / ".bin" / binary
    if not exe.exists():
        if shutil.which("npm") is None:
            pytest.skip(f"npm is not installed: cannot install {package}")
        folder.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(folder), package],
                capture_output=True, text=True, timeout=600,
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {package} took more than 10 minutes")
        if done.returncode != 0 or not exe.exists():
            pytest.skip(f"npm could not install {package}: {done.stderr.strip()[-500:]}")
    try:
        version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{package} does not start here: {exc}")
    if version.returncode != 0:
        pytest.skip(f"{package} does not start here: {version.stderr.strip()[-500:]}")
    return exe


def responses_served(base: str, route: str) -> dict[str, int]:
    """``mlx_trio_http_responses_total`` for ``route``, by status."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    pattern = rf'mlx_trio_http_responses_total{{route="{re.escape(route)}",status="(\d+)"}} (\d+)'
    return {status: int(float(n)) for status, n in re.findall(pattern, text)}


@pytest.fixture
def workdir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text(MARKER + "\n")
    return work


def serve_scripted(tmp_path, call: dict):
    model = build_scripted_model(tmp_path / "model", call=call, answer=ANSWER)
    return spawn_server(hypercorn_args, {"MLX_TRIO_MODEL": str(model)})


def test_claude_code_print_mode_runs_our_tool_call(tmp_path, workdir):
    claude = install_cli(CLAUDE_CODE, "claude")
    proc, base = serve_scripted(
        tmp_path, {"name": "Read", "arguments": {"file_path": str(workdir / "hello.txt")}}
    )
    try:
        home = tmp_path / "home"
        home.mkdir()
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": "sk-mlx-trio-test",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        run = subprocess.run(
            [str(claude), "-p", "Read hello.txt", "--output-format", "stream-json", "--verbose"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        tool_uses = [block for e in events if e.get("type") == "assistant"
                     for block in e["message"]["content"] if block["type"] == "tool_use"]
        assert [(t["name"], t["input"]) for t in tool_uses] == [
            ("Read", {"file_path": str(workdir / "hello.txt")})
        ]
        results = [block for e in events if e.get("type") == "user"
                   for block in e["message"]["content"]
                   if isinstance(block, dict) and block.get("type") == "tool_result"]
        assert len(results) == 1 and MARKER in json.dumps(results[0])
        (result,) = [e for e in events if e.get("type") == "result"]
        assert result["is_error"] is False and result["result"] == ANSWER
        assert result["num_turns"] == 2
        # Both turns reached us and were served (the second with the first one's prompt cached).
        assert responses_served(base, "/v1/messages") == {"200": 2}
        assert result["usage"]["cache_read_input_tokens"] > 10_000
    finally:
        stop_server(proc)


def test_codex_exec_runs_our_tool_call(tmp_path, workdir):
    codex = install_cli(CODEX, "codex")
    proc, base = serve_scripted(tmp_path, {"name": "exec_command", "arguments": {"cmd": "cat hello.txt"}})
    try:
        home = tmp_path / "codex-home"
        home.mkdir()
        (home / "config.toml").write_text(
            'model = "default_model"\nmodel_provider = "mlx"\n\n'
            "[model_providers.mlx]\n"
            'name = "mlx-trio-server"\n'
            f'base_url = "{base}/v1"\n'
            'wire_api = "responses"\n'
        )
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "CODEX_HOME": str(home)}
        run = subprocess.run(
            [str(codex), "exec", "--skip-git-repo-check", "Read hello.txt"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert run.stdout.strip() == ANSWER  # the last message, once the tool result was back
        assert "cat hello.txt" in run.stderr and MARKER in run.stderr  # the command ran
        assert responses_served(base, "/v1/responses") == {"200": 2}
    finally:
        stop_server(proc)


def test_opencode_run_runs_our_tool_call(tmp_path, workdir):
    """opencode with the provider docs/agents.md gives it: a title request, the agent's
    turn (its tools offered, our call of its ``read``) and the turn after the tool's
    result, which starts from the agent turn's cached prompt."""
    opencode = install_cli(OPENCODE, "opencode")
    proc, base = serve_scripted(
        tmp_path, {"name": "read", "arguments": {"filePath": str(workdir / "hello.txt")}}
    )
    try:
        home = tmp_path / "opencode-home"
        home.mkdir()
        (workdir / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"mlx": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx-trio-server",
                "options": {"baseURL": f"{base}/v1"},
                "models": {"default_model": {
                    "name": "mlx-trio-server", "limit": {"context": 131072, "output": 1024}}},
            }},
            "model": "mlx/default_model",
        }))
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home),
               "OPENCODE_DISABLE_AUTOUPDATE": "1"}
        run = subprocess.run(
            [str(opencode), "run", "Read hello.txt"],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert run.stdout.strip() == ANSWER  # given only once the tool's result was back
        shown = re.sub(r"\x1b\[[0-9;]*m", "", run.stderr).splitlines()
        assert "\u2192 Read hello.txt" in shown  # the tool call it ran, as it shows one
        assert responses_served(base, "/v1/chat/completions") == {"200": 3}
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["prompt_cache"]["cached_tokens"] > 5_000  # the follow-up's history
    finally:
        stop_server(proc)
