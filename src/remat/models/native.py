"""The compiled dequantization kernels (`dequantize.c`): built once per machine with its C compiler, called by ctypes.

`remat::dequantize` (`remat.models.quant`) makes a block type's weight here when it can: one pass that writes the
weight once, in float32 or bfloat16, on torch's thread count. Where it cannot (no C compiler, a failed build, a
scale that is not finite, another dtype or device) it answers None and the torch kernels make the weight: the same
values, bit for bit (tests/test_quant.py holds both to gguf-py). The library is kept under the user's cache folder,
named by a hash of the source, the flags and the CPU's features (it is built for this CPU: `-march=native`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

import gguf
import numpy as np
import torch

from remat.base.settings import Note
from remat.core import precision

Q = gguf.GGMLQuantizationType
SOURCE = Path(__file__).with_name("dequantize.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# Under this many values (4 M: a weight of ~10 ms) a weight is made on one thread. A thread started right after a
# torch op waits for the core that torch's own worker still spins on: SmolLM2's weights in a step took 0.9 ms each
# on two threads, 0.2-0.4 on one (the step's dequantization 0.42 s -> 0.19 s, bfloat16); its 28 M-value head,
# 29 ms on one, 21 on two.
ONE_THREAD = 1 << 22

__all__ = ["BUFFERS", "Buffers", "dequantize", "library"]


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "remat"


def _build(cc: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: processes may race
        built = Path(tmp) / path.name
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True, timeout=120)
        os.replace(built, path)
    for old in path.parent.glob("dequantize-*.so"):  # those of an earlier source; a process using one keeps it
        if old != path:
            old.unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built on first use; None (said once) where this machine cannot build or load them."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        warnings.warn("no C compiler (cc): GGUF blocks are made float by torch ops, slower", Note, stacklevel=2)
        return None
    built_for = repr((cc, FLAGS, sorted(precision.cpu_flags()))).encode()
    key = hashlib.sha256(SOURCE.read_bytes() + built_for).hexdigest()[:16]
    path = _cache() / f"dequantize-{key}.so"
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        said = e.stderr.decode(errors="replace").strip() if isinstance(e, subprocess.CalledProcessError) else e
        warnings.warn(f"the dequantization kernels did not build ({said}): GGUF blocks are made float by torch ops, "
                      "slower", Note, stacklevel=2)
        return None
    lib.remat_dequantize.restype = ctypes.c_int
    lib.remat_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
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
    out = BUFFERS.take(len(rows) * values * dtype.itemsize).view(dtype).view(len(rows), values)
    threads = torch.get_num_threads() if out.numel() >= ONE_THREAD else 1
    status = lib.remat_dequantize(qtype, rows.data_ptr(), len(rows), size, values, out.data_ptr(),
                                  dtype == torch.bfloat16, threads)
    return out if status == 0 else None


class Buffers:
    """Memory for the weights made here, used again once a weight made in it is freed.

    remat's process returns every freed tensor over 256 KiB to the kernel (`core/process.py`), so each weight made
    anew is fresh pages, and faulting them in cost more than making the values (SmolLM2, float32: 1.06 GB of
    weights a step, ~260,000 page faults, most of the op's 0.66 s a step). A weight is made in a numpy buffer handed
    to torch without a copy; when the last tensor on it is freed, the buffer comes back here (`weakref.finalize` on
    the array the tensor holds) for the next weight of its size. At most `kept` bytes wait here unused: a weight
    larger than that, or one more than fits, is freed as any tensor is."""

    def __init__(self, kept: int):
        self.kept, self.waiting = kept, 0
        self.free: dict[int, list[np.ndarray]] = {}
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            free = self.free.get(nbytes)
            buffer = free.pop() if free else None
            self.waiting -= nbytes if buffer is not None else 0
        if buffer is None:
            if nbytes > self.kept:
                return torch.empty(nbytes, dtype=torch.uint8)
            buffer = np.empty(nbytes, np.uint8)
        lent = buffer[:]  # the tensor holds this view; its end gives the buffer back
        weakref.finalize(lent, self._give_back, buffer)
        return torch.from_numpy(lent)

    def _give_back(self, buffer: np.ndarray) -> None:
        with self.lock:
            if self.waiting + buffer.nbytes <= self.kept:
                self.free.setdefault(buffer.nbytes, []).append(buffer)
                self.waiting += buffer.nbytes


BUFFERS = Buffers(kept=16 << 20)
