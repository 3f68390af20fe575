"""One configuration type behind the CLI flags and the environment variables."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from api.cli import TABLE_BEGIN, TABLE_END, build_parser, parse_config, settings_table
from api.server import create_app
from runtime.config import SETTINGS, ConfigError, ServerConfig, config_from_env
from runtime.config_checks import unsupported
from runtime.settings import BOOLEAN, ENV_PREFIX, GROUPS


def test_cli_defaults_match_mlx_lm_server():
    config = parse_config([])
    assert config == ServerConfig()
    assert (config.port, config.max_tokens, config.decode_concurrency) == (8080, 512, 32)
    assert (config.prompt_concurrency, config.prefill_step_size, config.prompt_cache_size) == (8, None, 64)


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
    problems = unsupported(parse_config(flags), distributed=True)
    assert any(fragment in p for p in problems), problems
    assert unsupported(parse_config(["--model", "m", "--pipeline"]), distributed=True) == []
    nccl_pipeline = parse_config(["--model", "m", "--pipeline", "--distributed-backend", "nccl"])
    assert any("send/recv" in p for p in unsupported(nccl_pipeline, distributed=True))


def test_a_follower_rank_refuses_to_serve_http(monkeypatch):
    monkeypatch.setenv("MLX_RANK", "1")
    with pytest.raises(SystemExit, match="other than 0"):
        create_app(parse_config(["--model", "m"]))


def test_with_no_model_the_embedded_demo_model_is_served():
    from pathlib import Path

    from runtime.config import ServerConfig
    from runtime.models import DEMO_MODEL_ID, resolve_model

    served_id, path = resolve_model(ServerConfig())
    assert served_id == DEMO_MODEL_ID == "mlx-trio-demo"
    assert (Path(path) / "model.safetensors").is_file()
    assert resolve_model(ServerConfig(model="/some/model")) == ("/some/model", "/some/model")


# ------------------------------------------------- one statement per setting


def test_every_field_declares_its_flag_variable_and_help():
    fields = attrs.fields(ServerConfig)
    assert [s.name for s in SETTINGS] == [f.name for f in fields]
    for s, field in zip(SETTINGS, fields, strict=True):
        assert s.flag == "--" + field.name.replace("_", "-"), s
        assert s.env == ENV_PREFIX + field.name.upper(), s
        assert s.help.strip() and s.format is not None, s
        default = field.default
        if isinstance(default, attrs.Factory):
            default = default.factory()
        assert s.default == default, s
    assert len({s.flag for s in SETTINGS}) == len({s.env for s in SETTINGS}) == len(SETTINGS)


def test_the_parser_has_one_flag_per_setting_and_restates_no_default():
    actions = {a.dest: a for a in build_parser()._actions if a.option_strings}
    for s in SETTINGS:
        action = actions.pop(s.name)
        assert action.option_strings == [s.flag]
        assert action.default == "==SUPPRESS==", (s.name, action.default)
        if s.choices is not None:
            assert tuple(action.choices) == s.choices
    assert set(actions) == {"help", "markdown"}


def test_every_setting_is_in_a_known_group_and_every_group_has_settings():
    assert len({g.title for g in GROUPS}) == len(GROUPS)
    for s in SETTINGS:
        assert s.group in GROUPS, s.name
    assert {s.group for s in SETTINGS} == set(GROUPS)
    assert [g.title for g in GROUPS][0] == "Model" and GROUPS[-1].title == "Advanced tuning"
    for g in GROUPS:
        assert g.description.strip() and "\n" not in g.description, g


def test_settings_are_listed_group_by_group():
    """``ServerConfig`` inherits its Advanced tuning fields (``runtime.tuning_settings``),
    which attrs would list first: ``complete_settings`` puts each in its group's place."""
    order = [GROUPS.index(s.group) for s in SETTINGS]
    assert order == sorted(order)
    assert [f.name for f in attrs.fields(ServerConfig)] == [s.name for s in SETTINGS]


def _help_sections(text: str) -> dict[str, list[str]]:
    """``--help``'s sections (a line ``Title:`` at the margin starts one): their lines."""
    sections: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            sections[line[:-1]] = []
        elif sections:
            sections[list(sections)[-1]].append(line)
    return sections


def test_help_lists_each_flag_under_its_group_in_the_groups_order(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: mlx-trio-server [options]")
    sections = _help_sections(text)
    assert list(sections) == ["options", *(g.title for g in GROUPS)]
    section_of_flag = {
        match.group(1): title
        for title, lines in sections.items()
        for line in lines
        if (match := re.match(r"  (?:-h, )?(--[a-z-]+)", line))
    }
    assert section_of_flag == {
        "--help": "options", "--markdown": "options",
        **{s.flag: s.group.title for s in SETTINGS},
    }
    for g in GROUPS:  # the description under the title, before the first flag
        lines = sections[g.title]
        assert " ".join(" ".join(lines[: lines.index("")]).split()) == g.description, g


def test_the_doc_tables_follow_the_groups():
    headings = re.findall(r"^### (.+)$", settings_table(), re.M)
    assert headings == [g.title for g in GROUPS]


# For every setting but the booleans: a valid value, not the default, as a user types it.
TEXT_VALUES = {
    "model": "/models/m", "adapter_path": "/adapters/a", "host": "0.0.0.0", "port": "9000",
    "allowed_origins": "http://a.example, http://b.example", "draft_model": "/models/d",
    "num_draft_tokens": "5", "log_level": "DEBUG", "chat_template": "{{ messages }}",
    "temp": "0.7", "top_p": "0.9", "top_k": "40", "min_p": "0.05", "max_tokens": "256",
    "chat_template_args": '{"enable_thinking": false}', "decode_concurrency": "16",
    "prompt_concurrency": "4", "prefill_step_size": "512", "prefill_group_tokens": "0",
    "prompt_cache_size": "3",
    "prompt_cache_bytes": "4GB", "kv_bits": "4", "kv_group_size": "32",
    "quantized_kv_start": "100", "max_queued_requests": "9", "max_request_bytes": "1000",
    "tokenizer_threads": "3", "request_timeout": "2.5", "kv_cache_budget_bytes": "512M",
    "kv_reply_reserve_tokens": "1024",
    "distributed_backend": "ring", "distributed_timeout": "30", "engine_mode": "thread",
    "prefill_attention": "mlx",
    "decode_attention": "mlx",
    "decode_grouped_min_mib": "64",
    "cpu_blas": "reference",
    "prefill_buffers": "clear",
    "decode_path": "mlx",
    "chunk_pass": "separate",
    "admission_window_ms": "5", "burst_wait_ms": "4", "prompt_cache_min_reuse": "0",
    "shared_prefill_min_tokens": "64", "decode_stall_factor": "3", "prompt_cache_scope": "shared",
    "prefill_floor_slack": "1.15",
    "prefill_chunk_parts": "2", "cuda_memory_pool": "keep", "paced_step_tokens": "512",
    "cuda_graphs": "ops",
    "decode_lane_padding": "0",
    "decode_row_reuse_steps": "0",
    "decode_shared_prefix_tokens": "8192", "decode_shared_prefix_budget_share": "0.25",
    "aborted_prefill_min_tokens": "0", "prompt_cache_dir": "/var/cache/mlx-trio/kv",
    "prompt_cache_dir_bytes": "4GB",
    "stream_interval_ms": "40",
    "api_key": "key-1, key-2", "api_key_file": "/etc/mlx-trio/keys",
    "allowed_models": "org/model,/models/m", "models_dir": "/models",
    "max_model_len": "4096", "max_choices": "2", "shutdown_grace": "3.5",
    "responses_store_path": "/var/lib/mlx-trio/responses.sqlite3", "responses_store_bytes": "1GB",
    "responses_store_max_age": "7d",
    "image_max_bytes": "1000000", "image_max_pixels": "65536", "image_fetch_timeout": "2.5",
    "embedding_model": "/models/bge-small", "embedding_batch_size": "8",
    "embedding_batch_tokens": "4096", "embedding_max_inputs": "100",
}


def _flag_and_variable(s) -> tuple[list[str], dict[str, str]]:
    if s.format is BOOLEAN:
        return [s.flag], {s.env: "true"}
    return [s.flag, TEXT_VALUES[s.name]], {s.env: TEXT_VALUES[s.name]}


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.name)
def test_a_flag_and_its_variable_give_the_same_config(s):
    flags, environ = _flag_and_variable(s)
    from_flags, from_env = parse_config(flags), config_from_env(environ)
    assert from_flags == from_env
    assert getattr(from_env, s.name) != s.default  # the value arrived


def test_all_flags_at_once_give_what_all_variables_give():
    flags, environ = [], {}
    for s in SETTINGS:
        more_flags, more_environ = _flag_and_variable(s)
        flags += more_flags
        environ |= more_environ
    config = parse_config(flags)
    assert config == config_from_env(environ)
    assert config.prompt_cache_bytes == 4 * 10**9 and config.kv_cache_budget_bytes == 512 * 10**6
    assert config.allowed_origins == ("http://a.example", "http://b.example")
    assert config.chat_template_args == {"enable_thinking": False}
    assert config.api_key == ("key-1", "key-2")
    assert config.allowed_models == ("org/model", "/models/m")


def test_list_flags_that_may_be_repeated_add_up():
    config = parse_config(["--allowed-models", "a", "--allowed-models", "b,c", "--api-key", "k"])
    assert config.allowed_models == ("a", "b", "c") and config.api_key == ("k",)
    assert parse_config(["--allowed-origins", "x", "--allowed-origins", "y"]).allowed_origins == (
        "y",
    )  # not repeatable: the last one wins, as in mlx_lm.server


@pytest.mark.parametrize("s", [s for s in SETTINGS if s.bounds_text()], ids=lambda s: s.name)
def test_a_value_out_of_bounds_is_refused_both_ways(s, capsys):
    low = s.above if s.above is not None else s.minimum
    bad = str(low - 1) if low is not None else str(s.maximum + 1)
    with pytest.raises(ConfigError, match=s.name):
        config_from_env({s.env: bad})
    try:
        parse_config([s.flag, bad])
    except ConfigError as exc:
        assert s.name in str(exc)
    except SystemExit as exc:  # a size is never negative: argparse's usage error
        assert exc.code == 2 and s.flag in capsys.readouterr().err
    else:
        pytest.fail(f"{s.flag} {bad} was accepted")
    if s.maximum is not None:
        with pytest.raises(ConfigError, match=s.name):
            config_from_env({s.env: str(s.maximum + 1)})


def test_the_configuration_doc_has_the_current_settings_table():
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    found = re.search(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END) + "\n", doc, re.S)
    assert found, "docs/configuration.md lost its settings table's markers"
    assert found.group(0) == settings_table(), (
        "docs/configuration.md's settings table is out of date: replace it with the output "
        "of `python -m api.cli --markdown`"
    )
