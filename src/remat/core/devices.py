"""Where a step runs: the `--device` setting resolved, the device a step is traced for, and what a device
changes about running and planning a step (its free memory, the optimizer's kernel, deterministic kernels).

`auto` is CUDA where present, else MPS, else the CPU. A step is planned for a device without it: `remat plan
--device cuda` on a machine without a GPU traces on fake tensors of the CPU device with CUDA's kernels chosen (the
planner traces for its device: `models.steps`, whose `hf.prepare` gives the model remat's attention for it, which
picks the SDPA kernel the device would run, `remat.core.attention`). Fake
tensors can be made on `cuda` in a CPU-only build, but autograd records a stream per device for every value it
will differentiate (`InputMetadata`), asks the device's guard for it, and a build without CUDA has none: the
process aborts (`torch._C._ensureCUDADeviceGuardSet` patches only a CUDA build without a device). A plan reads
bytes, layouts and storages, none of which depend on the fake device; what does depend on it (the kernel run,
the memory it holds inside, the optimizer) is chosen here from the device traced for.

MPS shares CUDA's path where torch does (SDPA's math kernel, fused AdamW) and is untested.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from remat.base.settings import GateRefused, UsageError

if TYPE_CHECKING:
    from remat.core.graph import TrainGraph

# CUDA's SM count where no CUDA device is present to ask (an H100 SXM, an H200): what a deterministic flash
# backward's accumulators are planned with when `remat plan --device cuda` runs without a GPU.
PLANNED_SMS = 132
# cuBLAS's workspace under CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS): 8 buffers of 4 MiB, taken
# from the caching allocator at the first matrix product on a stream; the step's plan does not hold it.
CUBLAS_CONFIG, CUBLAS_WORKSPACE = ":4096:8", 8 * 4 << 20


def _cuda_index(spec: str) -> int | None:
    return int(spec.split(":")[1]) if ":" in spec else None


def planned(spec: str = "auto") -> torch.device:
    """The device a plan is made for: `cuda[:N]` and `mps` whether or not this machine has one (planning needs
    none), `auto` this machine's."""
    if spec == "auto":
        return resolve(spec)
    if spec.startswith("cuda"):
        return torch.device("cuda", _cuda_index(spec) or 0)
    return torch.device(spec)


def resolve(spec: str = "auto") -> torch.device:
    """The device a step runs on, checked present: UsageError (one line) where it is not."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if torch.backends.mps.is_available() else torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(f"--device {spec}: {why} ({torch.__version__}); `remat plan --device {spec}` plans "
                             "such a job without one")
        index = _cuda_index(spec)
        if index is not None and index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    if spec == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps: MPS is not available here")
    return torch.device(spec)


def present(device: torch.device) -> bool:
    """Whether this machine has `device` (the CPU always)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    return device.type != "mps" or torch.backends.mps.is_available()


def name(device: torch.device) -> str:
    """The device as the receipt and the budget name it: `cpu`, `cuda:0 (NVIDIA H100 80GB HBM3)`, `mps`."""
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def is_host(device: torch.device | str) -> bool:
    """Whether the step's memory is the host's (the CPU): a device's plan splits device from host memory."""
    return torch.device(device).type == "cpu"


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (CUDA's, asked of it where present), else `PLANNED_SMS`."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return PLANNED_SMS


def optimizer_options(device: torch.device) -> dict:
    """AdamW's options on the device: CUDA and MPS update every parameter in place in one fused kernel, no
    temporaries (the plan's `workspace` is 0 there); the CPU keeps torch's single-tensor AdamW (three temporaries
    of the parameter it updates, measured)."""
    return {"fused": True} if device.type in ("cuda", "mps") else {}


def optimizer_workspace(device: torch.device | str, largest: int) -> int:
    """The plan's `workspace`: what the optimizer's update holds beyond the state, `largest` the largest
    trainable tensor's bytes (see `optimizer_options`)."""
    return 0 if torch.device(device).type in ("cuda", "mps") else 3 * largest


def prepare(device: torch.device) -> None:
    """Ready the process for steps on `device`. On CUDA: deterministic kernels, so that a recomputed step's
    losses and grads are bitwise the saved one's (atomically accumulated backwards, the flash backward's dQ
    and an embedding's gradient among them, sum in a different order on every run); cuBLAS needs its
    workspace configured for that before its first handle."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_CONFIG)
    torch.use_deterministic_algorithms(True)


def preflight(tg: TrainGraph, device: torch.device | str = "cpu", *, cpu_fallback: bool = False) -> None:
    """Refuse a graph holding an op that no available backend can run, naming it.

    An op runs if it has a kernel for the device (composite ops count), or, when
    `cpu_fallback` is allowed, a CPU kernel.
    """
    key = torch.device(device).type.upper()
    missing = set()
    for n in tg.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            name = n.target.name()
            has = torch._C._dispatch_has_computed_kernel_for_dispatch_key
            if not has(name, key) and not (cpu_fallback and has(name, "CPU")):
                missing.add(name)
    if missing:
        raise GateRefused(f"refused: no kernel on {key.lower()} for {', '.join(sorted(missing))}"
                          + ("" if cpu_fallback else " (and no CPU fallback allowed)"))
