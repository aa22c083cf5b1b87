"""Mamba's selective scan started from the state the walk carries in (Mamba, FalconMamba, Jamba).

transformers' `mamba_selective_scan` (its torch path: a loop over the tokens) always starts from a zero state: its
`mamba_scan_forward` reads the layer's recurrent state from the cache and hands it to nothing ("it is WRONG if the
cache is not empty", its own comment says). The walk's chunks would each start from zero. While the walk runs the
model (`carried`: the chunk's trace, the forward sweep, the probes), each such module's `mamba_scan_forward`
runs with its module's `mamba_selective_scan` bound to the layer's carried state: `scan_from`, the model's own
loop, op for op, from that state instead of zeros. From a zero state it is the model's function
bitwise (tests/test_scan.py holds it), so the walk's chunks compute what the window computes.
Without a bound state (the window path, a cache that holds none) the model's own function runs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

SCAN, FORWARD = "mamba_selective_scan", "mamba_scan_forward"  # transformers' functions, module-level per family


def scan_from(state: torch.Tensor, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
              delta_bias: torch.Tensor | None = None, delta_softplus: bool = False, return_last_state: bool = False,
              **kwargs: object) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """transformers' `mamba_selective_scan` (its recurrent loop: the path it takes on CPU without mambapy, and in
    training without compiling), its state starting at `state` (batch, intermediate, state size) instead of 0."""
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
    deltaB_u = discrete_B * hidden_states[:, :, :, None].float()
    ssm_state = state
    scan_outputs = []
    for index in range(hidden_states.shape[-1]):
        ssm_state = discrete_A[:, :, index] * ssm_state + deltaB_u[:, :, index]
        scan_outputs.append(torch.matmul(ssm_state.to(input_dtype), C[:, index, :].unsqueeze(-1))[:, :, 0])
    scan_output = torch.stack(scan_outputs, dim=-1)
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    return (scan_output, ssm_state) if return_last_state else scan_output


def _forward(module: nn.Module, *args: object, own: Callable, family: str, **kwargs: object):
    """The model's `mamba_scan_forward` (module, hidden_states, time_step, B, C, gate, cache), its module's scan
    bound, for this call, to the layer's carried state where the cache holds one (the walk's)."""
    cache = args[5] if len(args) > 5 else kwargs.get("cache")
    get: Callable | None = getattr(cache, "get_recurrent_state", None)
    state = get(module.layer_idx) if get is not None else None
    if state is None:  # the window path: no cache
        return own(module, *args, **kwargs)
    scans = sys.modules[family]
    plain = getattr(scans, SCAN)
    setattr(scans, SCAN, functools.partial(scan_from, state))
    try:
        return own(module, *args, **kwargs)
    finally:
        setattr(scans, SCAN, plain)


def _own(fn: Callable) -> Callable:
    return fn.keywords["own"] if isinstance(fn, functools.partial) and "own" in fn.keywords else fn


@contextlib.contextmanager
def carried(model: nn.Module) -> Iterator[None]:
    """While the walk runs `model`: its Mamba scans start from the state the cache carries in (re-entrant)."""
    names = {type(m).__module__ for m in model.modules()}
    modules = [sys.modules[n] for n in sorted(names)
               if n in sys.modules and callable(getattr(sys.modules[n], SCAN, None))
               and callable(getattr(sys.modules[n], FORWARD, None))]
    before = {m: getattr(m, FORWARD) for m in modules}
    for m, forward in before.items():
        setattr(m, FORWARD, functools.partial(_forward, own=_own(forward), family=m.__name__))
    try:
        yield
    finally:
        for m, forward in before.items():
            setattr(m, FORWARD, forward)
