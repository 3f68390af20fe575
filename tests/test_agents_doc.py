"""docs/agents.md names only what the server has, and its config snippets parse.

Every ``--flag`` the page mentions is one of the server's (``api.cli``'s
parser) or one of the agents' own that the page uses; every ``mlx_trio_*``
metric it names is in ``GET /metrics``'s exposition (rendered from
``actors.metrics`` as the server renders it); and its JSON, TOML and YAML
snippets (opencode.json, Codex's config.toml, Aider's settings) are valid.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics import RuntimeFigures, ServerMetrics
from api.cli import build_parser
from runtime.messages import EngineStats

DOC = Path(__file__).resolve().parents[1] / "docs" / "agents.md"

# Flags of the agents' own command lines (Aider, Codex, Claude Code) that the page uses.
AGENT_FLAGS = {
    "--edit-format", "--message", "--openai-api-base", "--openai-api-key",  # aider
    "--skip-git-repo-check",  # codex exec
    "--output-format",  # claude -p
}


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def server_flags() -> set[str]:
    return {flag for action in build_parser()._actions for flag in action.option_strings}


def exposed_metric_names() -> set[str]:
    """Every sample and family name ``GET /metrics`` can show, labelled families included."""
    figures = RuntimeFigures(
        model_ready=True, requests_in_flight=0, requests_running=0, requests_waiting=0,
        kv_reserved_bytes=0, kv_budget_bytes=0, engine_restarts=0, stats=EngineStats(),
        prompt_cache={"misses": {"no_entry": 0}, "evictions": 0, "evicted_bytes": 0},
    )
    metrics = ServerMetrics(lambda: figures)
    metrics.http_started()
    metrics.observe_response("/v1/messages", 200)
    text, _ = metrics.render()
    names = set()
    for family in text_string_to_metric_families(text.decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", doc_text(), flags=re.M | re.S)


def test_every_flag_the_page_names_is_a_server_flag_or_an_agents_own():
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc_text()))
    assert mentioned, "no flags found: the pattern or the page changed"
    unknown = mentioned - server_flags() - AGENT_FLAGS
    assert not unknown, f"docs/agents.md names flags the server does not have: {sorted(unknown)}"
    # The settings the page is about are the server's own.
    for flag in ("--max-tokens", "--max-model-len", "--prompt-cache-size", "--prompt-cache-bytes",
                 "--shared-prefill-min-tokens", "--aborted-prefill-min-tokens", "--decode-stall-factor",
                 "--request-timeout"):
        assert flag in mentioned and flag in server_flags(), flag


def test_every_metric_the_page_names_is_exposed():
    named = set(re.findall(r"`(mlx_trio_[a-z0-9_]+)", doc_text()))
    assert "mlx_trio_prompt_tokens_computed_total" in named
    missing = named - exposed_metric_names()
    assert not missing, f"docs/agents.md names metrics /metrics does not expose: {sorted(missing)}"


def test_the_config_snippets_parse():
    json_blocks = fenced_blocks("json")
    toml_blocks = fenced_blocks("toml")
    yaml_blocks = fenced_blocks("yaml")
    assert len(json_blocks) == 2 and len(toml_blocks) == 1 and len(yaml_blocks) == 1
    opencode, aider_metadata = (json.loads(block) for block in json_blocks)
    provider = opencode["provider"]["mlx"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"].endswith("/v1")
    assert opencode["model"] == "mlx/" + next(iter(provider["models"]))
    assert "max_input_tokens" in aider_metadata["openai/default_model"]
    codex = tomllib.loads(toml_blocks[0])
    assert codex["model_providers"][codex["model_provider"]]["wire_api"] == "responses"
    yaml = pytest.importorskip("yaml")
    (settings,) = yaml.safe_load(yaml_blocks[0])
    assert settings["name"] == "openai/default_model"
    assert settings["extra_params"]["max_tokens"] > 512
