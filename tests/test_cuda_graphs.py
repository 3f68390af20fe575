"""runtime.cuda_graphs: the MLX variables each --cuda-graphs choice sets, and the
operator's own values left as they are."""

from __future__ import annotations

import pytest

from runtime.cuda_graphs import CUDA_GRAPH_MODES, UNBOUNDED_MB, cuda_graph_environment


def test_mlx_sets_nothing():
    environ: dict[str, str] = {}
    assert cuda_graph_environment("mlx", environ) == []
    assert environ == {}


def test_ops_lifts_the_megabyte_limit_only():
    environ = {"PATH": "/bin"}
    assert cuda_graph_environment("ops", environ) == ["MLX_MAX_MB_PER_BUFFER"]
    assert environ == {"PATH": "/bin", "MLX_MAX_MB_PER_BUFFER": str(UNBOUNDED_MB)}
    assert int(environ["MLX_MAX_MB_PER_BUFFER"]) < 2**31  # MLX reads it as an int


def test_off_turns_graphs_off():
    environ: dict[str, str] = {}
    assert cuda_graph_environment("off", environ) == ["MLX_USE_CUDA_GRAPHS"]
    assert environ == {"MLX_USE_CUDA_GRAPHS": "0"}


@pytest.mark.parametrize("choice, name", [("ops", "MLX_MAX_MB_PER_BUFFER"),
                                          ("off", "MLX_USE_CUDA_GRAPHS")])
def test_the_operators_value_wins(choice, name):
    environ = {name: "250"}
    assert cuda_graph_environment(choice, environ) == []
    assert environ == {name: "250"}


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="sometimes"):
        cuda_graph_environment("sometimes", {})


def test_the_setting_takes_every_mode_and_defaults_to_no_graphs():
    from api.cli import parse_config

    assert parse_config([]).cuda_graphs == "off"
    for choice in CUDA_GRAPH_MODES:
        assert parse_config(["--cuda-graphs", choice]).cuda_graphs == choice


def test_the_engine_leaves_them_unset_without_cuda(monkeypatch, tiny_model_path):
    """MLX's Metal backend reads the same variables for its command buffers: the engine
    sets them only where MLX runs on CUDA (not on this CPU)."""
    import os

    import mlx.core as mx

    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core

    assert not mx.cuda.is_available()
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MLX_MAX_MB_PER_BUFFER", "MLX_USE_CUDA_GRAPHS")}
    monkeypatch.setattr(os, "environ", environ)  # the test's own copy
    for choice in ("ops", "off"):
        make_engine_core(ServerConfig(model=tiny_model_path, cuda_graphs=choice),
                         tiny_model_path)
        assert "MLX_MAX_MB_PER_BUFFER" not in environ
        assert "MLX_USE_CUDA_GRAPHS" not in environ
