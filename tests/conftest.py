"""Shared fixtures: a tiny random Qwen3 model built offline, and a running app."""

from __future__ import annotations

import pytest
import trio

from runtime.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", seed=0))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from pathlib import Path

    return load_tokenizer(Path(tiny_model_path))


async def wait_ready(client, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        while True:
            response = await client.get("/health")
            if response.status_code == 200:
                return
            await trio.sleep(0.05)
