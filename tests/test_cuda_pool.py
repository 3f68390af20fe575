"""runtime.cuda_pool: every device's default memory pool told to keep its memory,
through a stand-in for the CUDA driver's library (this machine has no GPU)."""

from __future__ import annotations

import ctypes
import logging

import runtime.cuda_pool as cuda_pool


class FakeDriver:
    """The driver calls keep_cuda_pool makes, on ``devices`` devices; ``fail``: the
    name of a call that returns an error."""

    def __init__(self, devices: int, fail: str | None = None):
        self.devices, self.fail = devices, fail
        self.thresholds: dict[int, tuple[int, int]] = {}  # pool -> (attribute, value)

    def _result(self, name: str) -> int:
        return 1 if name == self.fail else 0

    def cuInit(self, flags):
        return self._result("cuInit")

    def cuDeviceGetCount(self, count):
        ctypes.cast(count, ctypes.POINTER(ctypes.c_int))[0] = self.devices
        return self._result("cuDeviceGetCount")

    def cuDeviceGet(self, device, ordinal):
        ctypes.cast(device, ctypes.POINTER(ctypes.c_int))[0] = ordinal
        return 0

    def cuDeviceGetDefaultMemPool(self, pool, device):
        ctypes.cast(pool, ctypes.POINTER(ctypes.c_void_p))[0] = 1000 + device.value
        return 0

    def cuMemPoolSetAttribute(self, pool, attribute, value):
        threshold = ctypes.cast(value, ctypes.POINTER(ctypes.c_uint64))[0]
        self.thresholds[pool.value] = (attribute, threshold)
        return self._result("cuMemPoolSetAttribute")


def test_every_device_s_pool_keeps_all_it_reserved(monkeypatch):
    driver = FakeDriver(devices=2)
    monkeypatch.setattr(cuda_pool.ctypes, "CDLL", lambda name: driver)
    assert cuda_pool.keep_cuda_pool()
    assert driver.thresholds == {1000: (cuda_pool.RELEASE_THRESHOLD, 2**64 - 1),
                                 1001: (cuda_pool.RELEASE_THRESHOLD, 2**64 - 1)}


def test_no_driver_no_device_or_a_refusal_is_false(monkeypatch, caplog):
    def missing(name):
        raise OSError(name)

    monkeypatch.setattr(cuda_pool.ctypes, "CDLL", missing)
    assert not cuda_pool.keep_cuda_pool()
    monkeypatch.setattr(cuda_pool.ctypes, "CDLL", lambda name: FakeDriver(devices=0))
    assert not cuda_pool.keep_cuda_pool()
    refusing = FakeDriver(devices=1, fail="cuMemPoolSetAttribute")
    monkeypatch.setattr(cuda_pool.ctypes, "CDLL", lambda name: refusing)
    with caplog.at_level(logging.WARNING, logger="runtime.cuda_pool"):
        assert not cuda_pool.keep_cuda_pool()
    assert "memory pool kept its release threshold" in caplog.text
