"""Compile our CUDA kernels' sources with NVRTC on a machine without a GPU.

The masked decode kernels (``runtime.cuda_masked_decode_source``) are built by MLX on
the device the first time a process needs them; a syntax or template error then costs a
device call. This compiles the same text here, wrapped as MLX's ``cuda_kernel`` wraps
it (the header in ``mlx::core::cu``, each input with its shape, strides and number of
dimensions, the template values as constants in the kernel's body), for real code of
``--arch`` so that ptxas reports each kernel's registers, spills and shared memory, for
a few shapes of heads and rows per block. Exit status 1 where any fails to compile.

It needs NVRTC and the CUDA headers, neither of which the server installs: the
``nvidia-cuda-nvrtc`` wheel from PyPI (unpacked anywhere, ``--nvrtc`` its
``libnvrtc.so``) and a CUDA toolkit's ``include`` folder with its ``cccl`` (``--include``).

    python bench/cuda_source_check.py --nvrtc /tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime import cuda_masked_decode as decode  # noqa: E402

# What MLX's "mlx/backend/cuda/device/utils.cuh" gives a kernel that ours uses.
PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
"""
# (head dim, query heads a KV head, rows per block over a held prefix): Qwen3-0.6B's
# shape at its default and at one row a block, Llama-3-8B's, eight query heads a KV
# head, the largest head size, one query head with the most rows.
SHAPES = [(128, 2, None), (128, 2, 1), (128, 4, None), (64, 8, 2), (256, 4, 2), (64, 1, 16)]


def kernel(arguments: dict, values: dict, dtype: str) -> str:
    """One kernel as MLX's ``cuda_kernel`` wraps its ``arguments`` (``KERNELS``): half
    precision inputs, float32 split outputs, ``dtype`` for the merged one."""
    def ctype(name: str) -> str:
        return ("bool" if name == "mask" else "float" if name.startswith("split_")
                else dtype)

    params = [f"const {ctype(n)}* {n}, const __grid_constant__ Shape {n}_shape, "
              f"const __grid_constant__ Strides {n}_strides, const __grid_constant__ int {n}_ndim"
              for n in arguments["input_names"]]
    params += [f"{ctype(n)}* {n}" for n in arguments["output_names"]]
    constants = "\n".join(f"  constexpr int {k} = {v};" for k, v in values.items())
    return (f"__global__ void {arguments['name']}({', '.join(params)}) {{\n"
            f"  using T = {dtype};\n{constants}\n{arguments['source']}\n}}\n")


def program(dim: int, rep: int, rows: int, dtype: str) -> str:
    values = {"D": dim, "REP": rep, "EPL": decode.elements_per_lane(dim, rep),
              "SCALE_BITS": 1040187392, "THREADS": decode.THREADS,
              "KEYS_PER_LOAD": decode.KEYS_PER_LOAD, "KEYS_PER_SPLIT": decode.KEYS_PER_SPLIT,
              "ROWS": rows, "HELD_EPL": decode.elements_per_lane(dim, rep * rows)}
    header = "".join(dict.fromkeys(k.get("header", "") for k in decode.KERNELS.values()))
    return (PRELUDE + header
            + "".join(kernel(k, values, dtype) for k in decode.KERNELS.values()) + "}\n")


def compiled(nvrtc, text: str, options: list[str]) -> tuple[int, str]:
    handle = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(handle), text.encode(), b"kernels.cu", 0,
                                None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    encoded = [o.encode() for o in options]
    status = nvrtc.nvrtcCompileProgram(handle, len(encoded),
                                       (ctypes.c_char_p * len(encoded))(*encoded))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(handle, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(handle, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(handle))
    return status, log.value.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvrtc", required=True, help="path of libnvrtc.so")
    p.add_argument("--include", default="/usr/local/cuda/include",
                   help="the CUDA headers (cuda_bf16.h; cccl/ beneath it)")
    p.add_argument("--arch", default="sm_90", help="real architecture, so ptxas runs")
    ns = p.parse_args(argv)
    # NVRTC opens its builtins library by name: loaded first from beside it, it is found.
    for builtins in sorted(Path(ns.nvrtc).parent.glob("libnvrtc-builtins.so*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(ns.nvrtc)
    options = [f"--gpu-architecture={ns.arch}", "-std=c++17", f"-I{ns.include}",
               f"-I{ns.include}/cccl", "--ptxas-options=-v"]
    failed = 0
    for dim, rep, rows in SHAPES:
        rows = rows or decode.held_rows_per_block(dim, rep, 1 << 30)
        for dtype in ("__nv_bfloat16", "__half"):
            status, log = compiled(nvrtc, program(dim, rep, rows, dtype), options)
            failed += status != 0
            print(f"== head {dim}, {rep} query heads a KV head, {rows} rows a prefix block, "
                  f"{dtype}: {'compiled' if status == 0 else 'FAILED'}")
            for line in log.splitlines():
                if "error" in line or "Used" in line or "spill" in line or "entry" in line:
                    print("  " + line.strip()[:160])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
