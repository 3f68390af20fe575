"""The MLX settings a server needs (runtime.mlx_environment): set by the engine before
its first MLX operation, unless the operator set them."""

from __future__ import annotations

import os

from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.mlx_environment import (
    PREFILL_STEP_SIZES,
    SERVER_DEFAULTS,
    default_prefill_step_size,
    server_defaults,
)


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


def test_the_prefill_step_size_follows_the_device_unless_given(tiny_model_path):
    """mlx-lm's 2048-token steps on a GPU, 512 on the CPU, where MLX's attention computes
    a chunk's causally masked scores too; --prefill-step-size, where given, stands."""
    import mlx.core as mx

    class OnTheGpu:
        gpu = mx.gpu

        @staticmethod
        def default_device():
            return mx.Device(mx.gpu)

    assert PREFILL_STEP_SIZES == {"gpu": 2048, "cpu": 512}
    assert default_prefill_step_size(OnTheGpu) == 2048
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert default_prefill_step_size(mx) == 512
        chosen = make_engine_core(ServerConfig(model=tiny_model_path), tiny_model_path)
        given = make_engine_core(ServerConfig(model=tiny_model_path, prefill_step_size=1024),
                                 tiny_model_path)
    finally:
        mx.set_default_device(previous)
    assert chosen._batch.prefill_step_size == 512
    assert given._batch.prefill_step_size == 1024


class _CacheLimits:
    """Stands in for mlx.core's device_info / set_cache_limit."""

    def __init__(self, memory: int, limit: int):
        self.memory, self.limit = memory, limit

    def device_info(self):
        return {"memory_size": self.memory} if self.memory else {}

    def set_cache_limit(self, limit: int) -> int:
        previous, self.limit = self.limit, limit
        return previous


def test_the_free_buffer_cache_is_bounded_by_a_share_of_the_memory_never_raised():
    from runtime.mlx_environment import CACHE_SHARE, MIN_CACHE_BYTES, bound_buffer_cache

    gpu = _CacheLimits(memory=144 << 30, limit=144 << 30)  # MLX's default: the memory
    assert bound_buffer_cache(gpu) == int((144 << 30) * CACHE_SHARE) == gpu.limit
    small = _CacheLimits(memory=8 << 30, limit=8 << 30)
    assert bound_buffer_cache(small) == MIN_CACHE_BYTES == small.limit
    operator = _CacheLimits(memory=144 << 30, limit=1 << 30)  # already lower: kept
    assert bound_buffer_cache(operator) == 1 << 30 == operator.limit
    assert bound_buffer_cache(_CacheLimits(memory=0, limit=5)) is None
    cuda = _CacheLimits(memory=0, limit=141 << 30)  # CUDA's device_info: total_memory
    cuda.device_info = lambda: {"total_memory": 141 << 30, "free_memory": 100 << 30}
    assert bound_buffer_cache(cuda) == int((141 << 30) * CACHE_SHARE) == cuda.limit
