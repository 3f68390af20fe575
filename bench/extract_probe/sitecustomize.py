"""A benchmark probe, never part of the server: where a row's KV-cache leaves a batch
the host's time goes, part by part, in a running server.

On ``PYTHONPATH`` (``PYTHONPATH=bench/extract_probe:...``, as a server variant's
environment) Python imports it as ``sitecustomize`` in every process. Where
``MLX_TRIO_ENGINE_PROBE=PREFIX`` is set too (as the engine's step trace has it), it
wraps mlx-lm's ``BatchKVCache.extract``, ``BatchKVCache.extend`` and
``GenerationBatch.filter`` and appends a line per call to ``PREFIX-extract.PID``:

    X epoch layer_ms_eval ms_first_read ms_second_read ms_rest   (extract, per layer)
    J epoch ms_extend                                              (extend, per layer)
    F epoch ms_filter                                              (a batch's filter)

``ms_eval`` is ``mx.eval`` of the layer's left paddings (long where they were still
lazy), ``ms_first_read`` reading them back (long where reading a device-made array
waits for the device), ``ms_second_read`` the same read again (a host read), and
``ms_rest`` mlx-lm's ``extract`` itself once they are read. Nothing else changes.
"""

import os
import time

_prefix = os.environ.get("MLX_TRIO_ENGINE_PROBE")


def _install(prefix: str) -> None:
    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch
    from mlx_lm.models.cache import BatchKVCache

    out = open(f"{prefix}-extract.{os.getpid()}", "a", buffering=1)  # noqa: SIM115
    clock = time.perf_counter
    extract, extend, batch_filter = BatchKVCache.extract, BatchKVCache.extend, GenerationBatch.filter

    def timed_extract(self, idx):
        began = clock()
        mx.eval(self.left_padding)
        evaluated = clock()
        self.left_padding.tolist()
        read = clock()
        self.left_padding.tolist()
        read_again = clock()
        cache = extract(self, idx)
        ended = clock()
        out.write(f"X {time.time():.4f} {(evaluated - began) * 1e3:.3f} {(read - evaluated) * 1e3:.3f} "
                  f"{(read_again - read) * 1e3:.3f} {(ended - read_again) * 1e3:.3f}\n")
        return cache

    def timed_extend(self, other):
        began = clock()
        extend(self, other)
        out.write(f"J {time.time():.4f} {(clock() - began) * 1e3:.3f}\n")

    def timed_filter(self, keep):
        began = clock()
        batch_filter(self, keep)
        out.write(f"F {time.time():.4f} {(clock() - began) * 1e3:.3f}\n")

    # The server checks mlx-lm's sources (runtime.mlx_lm_batches): they read through.
    timed_extract.__wrapped__, timed_extend.__wrapped__ = extract, extend
    timed_filter.__wrapped__ = batch_filter
    BatchKVCache.extract, BatchKVCache.extend = timed_extract, timed_extend
    GenerationBatch.filter = timed_filter


if _prefix:
    try:
        _install(_prefix)
    except ImportError:  # a process without mlx-lm (the load generator)
        pass
