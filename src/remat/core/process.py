"""The process's own memory, as the kernel and the allocator see it: free memory, the resident set and its peak,
glibc's heap and torch's freed tensors (kept for reuse: `reuse.cpp`) made to follow what is live. The plans'
`runtime` and `trace` categories and every receipt's `process_peak` are measured here; the gate's default budget
is the free memory read here."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from remat.core import compiled


def available_memory(device: torch.device | str = "cpu") -> int:
    """Free memory of the device: on CPU the kernel's MemAvailable estimate; CUDA's `mem_get_info`; on MPS what the
    driver recommends at most less what it holds."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if torch.device(device).type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot read MemAvailable from /proc/meminfo")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, where the process has it."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_reusing: ctypes.CDLL | None = None  # the allocator of `reuse.cpp`, once torch allocates there
LARGE = 256 << 10  # bytes from which a block is a mapping of its own: glibc's (mmap) and torch's tensors (reuse.cpp)


def reuse_freed_memory() -> None:
    """Have torch's freed CPU tensors of 256 KiB and up kept for the next tensor of their size, never past the most
    ever live (`reuse.cpp`), and glibc give its own large freed blocks back to the kernel at once.

    By default glibc raises its mmap threshold as large blocks are freed (up to 32 MiB) and then serves
    them from its heap, which it cannot shrink past a live block: the process peak grows past what is live
    (SmolLM2 LoRA at ctx 1024, recompute on: 1,910 MiB against 1,303 with this set). 256 KiB, not 1 MiB: at ctx
    256 a layer's activations are 576 KiB (SmolLM2), and kept in the heap they grew the resident set by 90 MiB a step
    (the demo: 965 MiB after its third step, 700 with 256 KiB; its peak 1,273 against 1,168). A block given back is
    fresh pages when next taken, and faulting them in was a third of a CPU step (the demo in bfloat16: ~345,000
    faults a step, ~1.2 us each); torch's blocks are kept instead, as torch's CUDA allocator keeps them, and
    unmapped where a job ends and before the resident set is read (`give_back_kept`). Elsewhere (not Linux, no C++
    compiler: said once), the blocks go back to the kernel."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, LARGE)  # M_MMAP_THRESHOLD, which also turns the dynamic threshold off
    global _reusing  # noqa: PLW0603 (torch's allocator is the process's: one, for good)
    reuse = _reuse()
    if reuse is not None and reuse.remat_reuse_install(ctypes.c_size_t(LARGE)) == 0:
        _reusing = reuse


@functools.cache
def _reuse() -> ctypes.CDLL | None:
    """The allocator of `reuse.cpp`, built against this torch, where the process runs on Linux."""
    if sys.platform != "linux":
        return None
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ("-O2", "-std=c++17", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-I{torch_lib.parent / 'include'}", f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}")
    lib = compiled.load(Path(__file__).with_name("reuse.cpp"), flags, cpp=True, built_for=torch.__version__,
                        what="the CPU memory reuse", without="freed tensors go back to the kernel, slower")
    if lib is not None:
        lib.remat_reuse_kept_bytes.restype = ctypes.c_size_t
    return lib


def give_back_kept() -> None:
    """Unmap the freed tensors kept for reuse: at a job's end (a server lives on) and before the resident set is
    read as what is live."""
    if _reusing is not None:
        _reusing.remat_reuse_unmap_kept()


def kept_bytes() -> int:
    """Bytes of freed tensors the process keeps for reuse now (0 where it keeps none)."""
    return int(_reusing.remat_reuse_kept_bytes()) if _reusing is not None else 0


def trim_heap() -> None:
    """Collect garbage, then give back to the kernel the freed tensors kept for reuse and the heap memory glibc holds
    freed (`malloc_trim(0)`, every arena), so that the resident set is what is live. Where libc has no
    `malloc_trim`, only the collection and the kept tensors.

    Without it, a step that follows another in one process reuses the heap that step freed (tensors under
    the 256 KiB mmap threshold of `reuse_freed_memory`) without growing the resident set: its process peak
    above its start reads near 0 however much it allocates (the bench's interleaved variants)."""
    gc.collect()
    give_back_kept()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def keep_for_good() -> None:
    """Move what is alive into the collector's permanent generation (`gc.freeze`, at once): for a process that
    runs one job (`remat finetune`), whose imports (torch, transformers: ~370k objects) live until it exits. Each
    full collection (`trim_heap`, four a run) walked them again: ~180 ms each. Not collected first: after the
    imports a collection finds ~35 objects of garbage, not worth its 180 ms. Not for a server: an object frozen is
    never collected as part of a cycle, and a server's planners drop graphs for good."""
    gc.freeze()


def resident() -> int:
    """The process's resident set now (bytes), of what is live: the freed tensors kept for reuse are unmapped
    first (an allocation the reading just freed would count otherwise). The `runtime` category, read before the
    model loads."""
    give_back_kept()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (1 << 12)


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of these tensors' memory (each storage once) in the process's resident set now, by whole pages (the
    present bit of `/proc/self/pagemap`): weights a file maps lazily (safetensors) count only as far as they were
    read (a page of the file in the page cache is not the process's until it reads it). Where the pagemap cannot
    be read, a storage counts whole."""
    page = os.sysconf("SC_PAGE_SIZE")
    storages = {(st.data_ptr(), st.nbytes()) for t in tensors if (st := t.untyped_storage()).nbytes()}
    total = 0
    try:
        with open("/proc/self/pagemap", "rb") as f:
            for ptr, size in storages:
                first, last = ptr // page, (ptr + size - 1) // page
                f.seek(first * 8)
                entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
                total += min(size, int((entries >> np.uint64(63)).sum()) * page)
    except OSError:
        return sum(size for _, size in storages)
    return total


def reset_process_peak() -> None:
    """Start the kernel's peak resident set (VmHWM) again from the resident set now (Linux)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def process_peak() -> dict[str, int]:
    """What the whole process has taken at most so far: peak resident set (VmHWM), and on CUDA the
    allocator's peaks (`max_memory_allocated` in use, `max_memory_reserved` held)."""
    peak = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak["rss"] = int(line.split()[1]) * 1024
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_allocated"] = torch.cuda.max_memory_allocated()
        peak["cuda_reserved"] = torch.cuda.max_memory_reserved()
    return peak
