"""What a request may load: the served model, and what --allowed-models / --models-dir allow.

A model the policy does not allow is a 404 before anything is loaded (the
model-load histogram still counts only the start-up load, the served model
stays loaded); ``GET /v1/models`` lists exactly what is allowed.
"""

from __future__ import annotations

import os

import pytest

from api.server import create_app
from runtime.config import ServerConfig
from runtime.errors import NotFound
from runtime.models import ModelPolicy, allowed_model_ids, resolve_key
from runtime.tiny_model import build_tiny_model
from tests.conftest import wait_ready
from tests.test_api import CHAT, chat_body, post
from tests.test_metrics import scrape, value


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """A folder of models: ``one`` and ``org/two``; ``notes`` has no config.json."""
    root = tmp_path_factory.mktemp("models")
    build_tiny_model(root / "one", seed=2)
    build_tiny_model(root / "org" / "two", seed=3)
    (root / "notes").mkdir()
    return root


# ------------------------------------------------------------ the policy itself


def test_by_default_nothing_else_is_allowed(models_dir):
    policy = ModelPolicy.from_config(ServerConfig())
    for name in (str(models_dir / "one"), "org/two", "mlx-community/Qwen3-0.6B-4bit"):
        with pytest.raises(NotFound) as refused:
            policy.allowed(name, param="model")
        assert refused.value.param == "model" and "not served here" in refused.value.message


def test_star_allows_anything():
    policy = ModelPolicy.from_config(ServerConfig(allowed_models=("*",)))
    assert policy.allowed("/any/where", param="model") == "/any/where"


def test_entries_are_matched_as_written_or_as_the_same_directory(models_dir):
    policy = ModelPolicy.from_config(
        ServerConfig(allowed_models=(str(models_dir / "one"), "org/repo"))
    )
    assert policy.allowed("org/repo", param="model") == "org/repo"
    same = os.path.relpath(models_dir / "one")  # another spelling of the same folder
    assert policy.allowed(same, param="model") == same
    with pytest.raises(NotFound):
        policy.allowed(str(models_dir / "org" / "two"), param="model")


def test_a_models_dir_allows_what_is_inside_it_only(models_dir, tmp_path):
    policy = ModelPolicy.from_config(ServerConfig(models_dir=str(models_dir)))
    assert policy.allowed("org/two", param="model") == str(models_dir / "org" / "two")
    inside = str(models_dir / "one")
    assert policy.allowed(inside, param="model") == inside
    for outside in ("../elsewhere", "org/../../elsewhere", str(tmp_path), str(models_dir)):
        with pytest.raises(NotFound):
            policy.allowed(outside, param="adapters")
    escape = models_dir / "escape"  # a link inside that points outside
    if not escape.exists():
        escape.symlink_to(tmp_path)
    with pytest.raises(NotFound):
        policy.allowed("escape", param="model")


@pytest.mark.parametrize("name", ["x" * 300, "~no-such-user-here/model"])
def test_names_that_cannot_be_paths_are_refused_not_crashed(models_dir, name):
    """Too long for a file name, or ``~`` of no such user: a 404, whatever the policy."""
    served = str(models_dir / "one")
    for config in (
        ServerConfig(model=served),
        ServerConfig(model=served, models_dir=str(models_dir)),
        ServerConfig(model=served, allowed_models=(str(models_dir / "org" / "two"),)),
    ):
        policy = ModelPolicy.from_config(config)
        with pytest.raises(NotFound):
            resolve_key(config, served, served, model=name, policy=policy)


def test_the_listing_is_what_the_policy_allows(models_dir):
    policy = ModelPolicy.from_config(
        ServerConfig(models_dir=str(models_dir), allowed_models=("no/such-repo", str(models_dir / "one")))
    )
    assert allowed_model_ids(policy) == [str(models_dir / "one"), "one", "org/two"]


# ------------------------------------------------------------------ end to end


async def test_a_model_that_is_not_allowed_is_a_404_before_anything_loads(
    tiny_model_path, models_dir
):
    app = create_app(ServerConfig(model=tiny_model_path))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        for field, name in (
            ("model", str(models_dir / "one")),  # a real model that would load
            ("model", "org/two"),
            ("adapters", str(models_dir / "one")),
            ("draft_model", str(models_dir / "one")),
        ):
            status, body, _ = await post(client, CHAT, {**chat_body(), field: name})
            assert status == 404, body
            assert body["error"]["param"] == field and "not served here" in body["error"]["message"]
        samples, _ = await scrape(client)
        assert value(samples, "mlx_trio_model_load_seconds_count") == 1  # the start-up load only
        health = await (await client.get("/health")).get_json()
        assert health["model"] == tiny_model_path and health["model_state"] == "ready"
        assert app.extensions["runtime"].model_loader.status().pending is None
        listed = await (await client.get("/v1/models")).get_json()
        assert [card["id"] for card in listed["data"]] == [tiny_model_path]
        # The served model under any of its names is still fine.
        for name in ("default_model", tiny_model_path):
            status, body, _ = await post(client, CHAT, {**chat_body(max_tokens=2), "model": name})
            assert status == 200, body


async def test_a_models_dir_lets_requests_name_its_models(tiny_model_path, models_dir):
    app = create_app(ServerConfig(model=tiny_model_path, models_dir=str(models_dir)))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        listed = await (await client.get("/v1/models")).get_json()
        assert [card["id"] for card in listed["data"]] == [tiny_model_path, "one", "org/two"]
        card = await (await client.get("/v1/models/org/two")).get_json()
        assert card["id"] == "org/two"
        status, body, _ = await post(client, CHAT, {**chat_body(max_tokens=2), "model": "org/two"})
        assert status == 200, body
        health = await (await client.get("/health")).get_json()
        assert health["model"] == str(models_dir / "org" / "two")
        status, body, _ = await post(client, CHAT, {**chat_body(), "model": "../outside"})
        assert status == 404 and body["error"]["param"] == "model"


async def test_an_allowed_model_is_listed_and_served(tiny_model_path, models_dir):
    other = str(models_dir / "one")
    app = create_app(ServerConfig(model=tiny_model_path, allowed_models=(other,)))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        listed = await (await client.get("/v1/models")).get_json()
        assert [card["id"] for card in listed["data"]] == [tiny_model_path, other]
        status, body, _ = await post(client, CHAT, {**chat_body(max_tokens=2), "model": other})
        assert status == 200, body
        status, body, _ = await post(
            client, CHAT, {**chat_body(), "model": str(models_dir / "org" / "two")}
        )
        assert status == 404
