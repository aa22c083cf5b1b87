"""The compiled dequantization kernels (`dequantize.c`): built once per machine with its C compiler, called by ctypes.

`remat::dequantize` (`remat.models.quant`) makes a block type's weight here when it can: one pass that writes the
weight once, in float32 or bfloat16, on torch's threads (the OpenMP team torch's ops run on). Where it cannot (no C
compiler, a failed build, a scale that is not finite, another dtype or device) it answers None and the torch kernels
make the weight: the same values, bit for bit (tests/test_quant.py holds both to gguf-py). The library is built for
this CPU (`-march=native`, its features in the build's key: `remat.core.compiled`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import gguf
import torch

from remat.core import compiled, precision

Q = gguf.GGMLQuantizationType
SOURCE = Path(__file__).with_name("dequantize.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")
TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})

__all__ = ["dequantize", "library"]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built on first use; None (said once) where this machine cannot build or load them."""
    lib = compiled.load(SOURCE, FLAGS, cpp=False, built_for=sorted(precision.cpu_flags()),
                        what="the dequantization kernels", without="GGUF blocks are made float by torch ops, slower")
    if lib is not None:
        lib.remat_dequantize.restype = ctypes.c_int
        lib.remat_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def dequantize(rows: torch.Tensor, qtype: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The values of `rows` (uint8 `[blocks, block bytes]` on the CPU) as `[blocks, block values]` in `dtype`, or
    None where the kernels cannot make them (see the module's docstring)."""
    if qtype not in TYPES or dtype not in (torch.float32, torch.bfloat16) or rows.device.type != "cpu":
        return None
    lib = library()
    if lib is None:
        return None
    values, size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    rows = rows.contiguous()
    out = torch.empty(len(rows), values, dtype=dtype)
    status = lib.remat_dequantize(qtype, rows.data_ptr(), len(rows), size, values, out.data_ptr(),
                                  dtype == torch.bfloat16, torch.get_num_threads())
    return out if status == 0 else None
