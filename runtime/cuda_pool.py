"""CUDA's default memory pool, told to keep the memory it has reserved.

Owns ``keep_cuda_pool()`` (and ``cuda_devices()``, the driver and its devices, which
benchmarks that set the driver's other knobs share): it receives nothing (it reads the devices through the CUDA
driver's API) and sets the release threshold of every device's default memory pool,
the pool MLX's ``cudaMallocAsync`` allocates from, to its maximum. Emits nothing; it
returns whether every pool took it.

Why: a pool's default threshold is 0, so at every synchronisation (an engine
synchronises at every decode step, to read its tokens) the pool gives the memory its
freed buffers held back to the system, and the next allocation that needs it maps
memory anew. MLX keeps freed buffers for reuse only up to its cache limit, which the
server bounds (``runtime.mlx_environment.bound_buffer_cache``), and frees the rest
into the pool. A pool that keeps its memory serves those allocations from what it
holds, of any size, and the memory stays the server's: on a device it has to itself,
nothing else wanted it.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

RELEASE_THRESHOLD = 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD


def cuda_devices() -> tuple[ctypes.CDLL, list[ctypes.c_int]] | None:
    """The CUDA driver's library, initialised, and its devices' handles; None without a
    driver, or where it has no device or refuses."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int()
    if driver.cuInit(0) or driver.cuDeviceGetCount(ctypes.byref(count)) or not count.value:
        return None
    devices = []
    for ordinal in range(count.value):
        device = ctypes.c_int()
        if driver.cuDeviceGet(ctypes.byref(device), ordinal):
            return None
        devices.append(device)
    return driver, devices


def keep_cuda_pool() -> bool:
    """Set every CUDA device's default memory pool's release threshold to its maximum;
    whether every one took it (False without a CUDA driver)."""
    found = cuda_devices()
    if found is None:
        return False
    driver, devices = found
    threshold = ctypes.c_uint64(2**64 - 1)
    for device in devices:
        pool = ctypes.c_void_p()
        failed = (driver.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device)
                  or driver.cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, ctypes.byref(threshold)))
        if failed:
            log.warning("CUDA device %d's memory pool kept its release threshold (error %d)",
                        device.value, failed)
            return False
    return True
