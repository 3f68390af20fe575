"""The MLX settings a server needs (runtime.mlx_environment): set by the engine before
its first MLX operation, unless the operator set them."""

from __future__ import annotations

import os

from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.mlx_environment import SERVER_DEFAULTS, server_defaults


def test_server_defaults_fill_in_what_the_operator_left_unset():
    environ = {"MLX_CUDA_SDPA_CACHE_SIZE": "64", "PATH": "/bin"}
    assert server_defaults(environ) == ["MLX_ENABLE_CACHE_THRASHING_CHECK"]
    assert environ == {
        "MLX_CUDA_SDPA_CACHE_SIZE": "64",  # the operator's value stands
        "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
        "PATH": "/bin",
    }
    assert server_defaults(environ) == []  # nothing left to set


def test_the_engine_sets_them_before_it_loads(monkeypatch, tiny_model_path):
    """MLX's CUDA caches read these when first used: the engine sets them as it starts."""
    import runtime.engine.loading as loading

    environ = {k: v for k, v in os.environ.items() if k not in SERVER_DEFAULTS}
    monkeypatch.setattr(os, "environ", environ)  # the test's own copy
    at_load = {}
    load_model = loading.load_model

    def load_and_look(*args, **kwargs):
        at_load.update({name: environ.get(name) for name in SERVER_DEFAULTS})
        return load_model(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model", load_and_look)
    make_engine_core(ServerConfig(model=tiny_model_path), tiny_model_path)
    assert at_load == SERVER_DEFAULTS
