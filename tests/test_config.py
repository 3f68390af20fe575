"""One configuration type behind the CLI flags and the environment variables."""

from __future__ import annotations

import pytest

from api.server import create_app
from runtime.cli import parse_config
from runtime.config import ConfigError, ServerConfig, config_from_env


def test_cli_defaults_match_mlx_lm_server():
    config = parse_config([])
    assert config == ServerConfig()
    assert (config.port, config.max_tokens, config.decode_concurrency) == (8080, 512, 32)
    assert (config.prompt_concurrency, config.prefill_step_size, config.prompt_cache_size) == (8, 2048, 10)


def test_cli_and_env_give_the_same_config():
    cli = parse_config([
        "--model", "/m", "--max-tokens", "256", "--allowed-origins", "a,b",
        "--chat-template-args", '{"enable_thinking": false}', "--prompt-cache-bytes", "4GB",
        "--trust-remote-code", "--engine-mode", "thread", "--admission-window-ms", "5",
        "--prompt-cache-min-reuse", "0",
    ])
    env = config_from_env({
        "MLX_TRIO_MODEL": "/m", "MLX_TRIO_MAX_TOKENS": "256", "MLX_TRIO_ALLOWED_ORIGINS": "a,b",
        "MLX_TRIO_CHAT_TEMPLATE_ARGS": '{"enable_thinking": false}',
        "MLX_TRIO_PROMPT_CACHE_BYTES": "4GB", "MLX_TRIO_TRUST_REMOTE_CODE": "1",
        "MLX_TRIO_ENGINE_MODE": "thread", "MLX_TRIO_ADMISSION_WINDOW_MS": "5",
        "MLX_TRIO_PROMPT_CACHE_MIN_REUSE": "0",
    })
    assert cli == env
    assert env.prompt_cache_bytes == 4 * 10**9
    assert env.allowed_origins == ("a", "b")
    assert env.engine_mode == "thread" and env.admission_window_ms == 5.0
    assert env.prompt_cache_min_reuse == 0 and ServerConfig().prompt_cache_min_reuse == 64


@pytest.mark.parametrize(
    "environ, fragment",
    [
        ({"MLX_TRIO_MAX_TOKENS": "many"}, "max_tokens"),
        ({"MLX_TRIO_MAX_TOKENS": "-1"}, "max_tokens"),
        ({"MLX_TRIO_LOG_LEVEL": "loud"}, "log_level"),
        ({"MLX_TRIO_NO_SUCH_SETTING": "1"}, "MLX_TRIO_NO_SUCH_SETTING"),
        ({"MLX_TRIO_TRUST_REMOTE_CODE": "perhaps"}, "boolean"),
        ({"MLX_TRIO_ENGINE_MODE": "fork"}, "engine_mode"),
        ({"MLX_TRIO_ADMISSION_WINDOW_MS": "-1"}, "admission_window_ms"),
        ({"MLX_TRIO_PROMPT_CACHE_MIN_REUSE": "-5"}, "prompt_cache_min_reuse"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(environ, fragment):
    with pytest.raises(ConfigError, match=fragment):
        config_from_env(environ)


def test_pipeline_outside_a_distributed_launch_fails_loudly_at_start(monkeypatch):
    monkeypatch.delenv("MLX_RANK", raising=False)
    with pytest.raises(SystemExit, match="mlx.launch"):
        create_app(parse_config(["--pipeline"]))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ([], "needs --model"),
        (["--model", "m", "--draft-model", "d"], "--draft-model is not supported"),
        (["--model", "m", "--kv-bits", "4"], "--kv-bits is not supported"),
        (["--model", "m", "--adapter-path", "a"], "--adapter-path is not supported"),
    ],
)
def test_distributed_launch_refuses_what_sharded_load_cannot_do(flags, fragment):
    problems = parse_config(flags).unsupported(distributed=True)
    assert any(fragment in p for p in problems), problems
    assert parse_config(["--model", "m", "--pipeline"]).unsupported(distributed=True) == []
    nccl_pipeline = parse_config(["--model", "m", "--pipeline", "--distributed-backend", "nccl"])
    assert any("send/recv" in p for p in nccl_pipeline.unsupported(distributed=True))


def test_a_follower_rank_refuses_to_serve_http(monkeypatch):
    monkeypatch.setenv("MLX_RANK", "1")
    with pytest.raises(SystemExit, match="other than 0"):
        create_app(parse_config(["--model", "m"]))


def test_with_no_model_the_embedded_demo_model_is_served():
    from pathlib import Path

    from runtime.config import ServerConfig
    from runtime.supervisor import DEMO_MODEL_ID, resolve_model

    served_id, path = resolve_model(ServerConfig())
    assert served_id == DEMO_MODEL_ID == "mlx-trio-demo"
    assert (Path(path) / "model.safetensors").is_file()
    assert resolve_model(ServerConfig(model="/some/model")) == ("/some/model", "/some/model")
