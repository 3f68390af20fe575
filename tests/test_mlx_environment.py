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


class _Layer:
    def __init__(self, nbytes: int):
        self.keys = self.values = type("Array", (), {"nbytes": nbytes})()


class _Device(_CacheLimits):
    """Also counts ``synchronize``, MLX's wait for the device."""

    waits = 0

    def synchronize(self):
        self.waits += 1


def test_a_batch_waits_for_the_device_before_a_copy_only_when_it_is_large():
    import os

    from runtime.mlx_environment import (
        BATCH_COPY_WAIT_SHARE,
        large_batch_bytes,
        wait_before_batch_copy,
    )

    memory = 80 << 30
    device = _Device(memory=memory, limit=memory)
    share = int(memory * BATCH_COPY_WAIT_SHARE)
    # 28 layers holding just under the share in keys and values: no wait
    small = [_Layer((share - 28) // 56)] * 28
    assert not wait_before_batch_copy(device, small) and device.waits == 0
    large = [_Layer(share // 56 + 1)] * 28
    assert wait_before_batch_copy(device, large) and device.waits == 1
    assert not wait_before_batch_copy(device, [])
    # MLX's CPU backend reports no memory: the share is of the machine's RAM
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = _Device(memory=0, limit=0)
    share = int(ram * BATCH_COPY_WAIT_SHARE)
    assert large_batch_bytes(cpu) == share
    assert not wait_before_batch_copy(cpu, [_Layer((share - 2) // 2)]) and cpu.waits == 0
    assert wait_before_batch_copy(cpu, [_Layer(share // 2 + 1)]) and cpu.waits == 1


def test_the_default_kv_budget_leaves_room_for_a_batch_copied_whole():
    """A share of what the weights leave, small enough that the batch, one copy of it
    and the prompt cache fit; at least that share of a quarter of the memory."""
    import os

    from runtime.mlx_environment import KV_BUDGET_SHARE, default_kv_budget

    memory = 80 << 30
    device = _CacheLimits(memory=memory, limit=memory)
    assert default_kv_budget(device) == int(memory * KV_BUDGET_SHARE)
    budget = default_kv_budget(device, weights_bytes=16 << 30)
    assert budget == int((64 << 30) * KV_BUDGET_SHARE)
    assert 2 * budget + (16 << 30) < memory * 0.9
    assert default_kv_budget(device, weights_bytes=79 << 30) == int(memory // 4 * KV_BUDGET_SHARE)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_kv_budget(_CacheLimits(memory=0, limit=0)) == int(ram * KV_BUDGET_SHARE)


def test_the_default_prompt_cache_budget_and_a_full_batch_copied_fit_the_memory():
    """The cache holds at most its share less the batch's caches; with the batch at the
    KV budget and copied once, the KV caches and the weights stay well under the memory."""
    from runtime.mlx_environment import (
        PROMPT_CACHE_BUDGET_SHARE,
        default_kv_budget,
        default_prompt_cache_budget,
    )

    memory = 80 << 30
    device = _CacheLimits(memory=memory, limit=memory)
    weights = 2 << 30
    cache = default_prompt_cache_budget(device, weights_bytes=weights)
    assert cache == int((memory - weights) * PROMPT_CACHE_BUDGET_SHARE)
    batch = default_kv_budget(device, weights_bytes=weights)
    assert cache > batch  # a full batch still leaves the cache some room
    # the cache given way to a full batch, the batch, its copy, the weights
    assert (cache - batch) + 2 * batch + weights < memory * 0.85
    assert default_prompt_cache_budget(device, weights_bytes=79 << 30) == int(
        memory // 4 * PROMPT_CACHE_BUDGET_SHARE
    )


def test_the_weights_bytes_are_the_parameters_bytes(tiny_model_path):
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from runtime.mlx_environment import weights_bytes

    model, _ = load(str(tiny_model_path))
    counted = weights_bytes(model)
    assert counted == sum(v.size * v.itemsize for _, v in tree_flatten(model.parameters()))
    assert counted > 0
