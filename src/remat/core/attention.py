"""SDPA with the kernel remat chooses for the device a step is traced for: flash, memory-efficient or math.

torch's `scaled_dot_product_attention` picks its kernel at run time from the tensors' device, dtype, shapes and
the GPU's generation. remat picks it itself, from what the step allows, and calls that kernel's op, so the graph
planned on fake tensors (on a machine without the device: `remat.core.devices`) holds the op the real run will
run, with the values it saves for the backward (flash's and efficient's logsumexp) as nodes of the graph, and
what its backward holds inside planned at that node (`workspaces`).

The rules are torch's own for CUDA (`sdp_utils`), where they depend on the step alone:
- flash: fp16 or bf16, no mask (plain causal only, square), one head size for q, k and v, a multiple of 8 up to
  256; grouped-query attention native.
- efficient: fp16, bf16 or fp32, any additive mask (a boolean one becomes 0 / -inf, padded to 16 keys as torch
  pads it), head sizes aligned (8 elements in half precision, 4 in fp32); grouped keys and values repeated first.
- math: anything else (fp64; MPS, which remat runs only through what it shares with CUDA).
On CUDA they run deterministic (`devices.prepare`): flash's backward then holds one fp32 dQ accumulator per
split of the SMs over batch x heads. A test where a GPU is present holds the choice to torch's `can_use_*`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch.overrides import TorchFunctionMode

from remat.core import devices

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
HALF = (torch.float16, torch.bfloat16)
# the ops of the kernels remat chooses on CUDA, and their backwards (whose workspace it plans)
KERNEL_OPS = {FLASH: torch.ops.aten._scaled_dot_product_flash_attention.default,
              EFFICIENT: torch.ops.aten._scaled_dot_product_efficient_attention.default}
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
BIAS_ALIGNMENT = 16  # keys a memory-efficient kernel's additive mask is padded to (torch's `preprocess_mask`)


def kernel(device: torch.device, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool) -> str:
    """The kernel attention runs on `device` for queries `q` (batch, heads, tokens, head size), keys `k` and
    values `v` (their heads may divide q's), with `mask` (None: none, or plain causal with `is_causal`)."""
    if device.type != "cuda":
        return MATH
    d = q.shape[-1]
    grouped_ok = q.shape[1] % k.shape[1] == 0
    square = not is_causal or q.shape[-2] == k.shape[-2]
    if (q.dtype in HALF and mask is None and k.shape[-1] == d == v.shape[-1] and d % 8 == 0 and d <= 256
            and square and grouped_ok):
        return FLASH
    align = 8 if q.dtype in HALF else 4
    if q.dtype in (*HALF, torch.float32) and k.shape[-1] == d and d % align == 0 and v.shape[-1] % align == 0:
        return EFFICIENT
    return MATH


def sdpa(device: torch.device, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
         scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` by the op of the kernel `kernel` chooses for `device`."""
    chosen = kernel(device, query, key, value, attn_mask, is_causal)
    if chosen == FLASH:
        return KERNEL_OPS[FLASH](query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if chosen == MATH:
        return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                                  scale=scale, enable_gqa=enable_gqa)[0]
    if key.shape[1] != query.shape[1]:  # grouped keys and values: the efficient kernel takes them per head
        key, value = _repeated(key, query.shape[1]), _repeated(value, query.shape[1])
    bias = None if attn_mask is None else _bias(attn_mask, query, key)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return KERNEL_OPS[EFFICIENT](query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]


def _repeated(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped heads repeated to `heads` (transformers' `repeat_kv`: each group's head next to its copies)."""
    b, groups, n, d = t.shape
    return t[:, :, None].expand(b, groups, heads // groups, n, d).reshape(b, heads, n, d)


def _bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The additive mask of the memory-efficient kernel: a boolean mask as 0 / -inf in the queries' dtype, its keys
    padded to a multiple of `BIAS_ALIGNMENT` (the kernel reads rows aligned) and cut back, broadcast in full."""
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        mask = torch.where(mask, zero, torch.full((), float("-inf"), dtype=q.dtype, device=q.device))
    keys = mask.shape[-1]
    if keys % BIAS_ALIGNMENT:
        mask = F.pad(mask, (0, BIAS_ALIGNMENT - keys % BIAS_ALIGNMENT))[..., :keys]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


class _Routed(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to `sdpa` for one device; every other call passes."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return sdpa(self.device, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def routed(device: torch.device) -> _Routed:
    """While on (around one attention call: a mode sees every torch call), SDPA runs the kernel remat chose."""
    return _Routed(device)


# ---------------------------------------------------------------------------------------------- workspace


def _val(node: fx.Node, i: int) -> torch.Tensor:
    return node.args[i].meta["val"]  # type: ignore[union-attr]


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _copied_unless_blhd(t: torch.Tensor) -> int:
    """The bytes of the copy a kernel makes of a (batch, heads, tokens, size) tensor not dense as (batch, tokens,
    heads, size), the layout both kernels read (`contiguous()` of its transpose)."""
    return 0 if t.transpose(1, 2).is_contiguous() else t.numel() * t.element_size()


def _flash_backward(sms: int, node: fx.Node) -> int:
    """What flash's backward holds beyond its results (`mha_bwd`): the softmax's row sums, the fp32 dQ
    accumulator (one per split of the SMs over batch x heads, deterministic), dK and dV per query head where keys
    are grouped, and dense copies of the output and its gradient where they are not laid out as it reads them."""
    grad_out, q, k, out = _val(node, 0), _val(node, 1), _val(node, 2), _val(node, 4)
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    rows = _up(lq, 128)
    size = _up(d, 8)
    splits = -(-sms // (b * h))
    held = b * h * rows * 4 + splits * b * rows * h * _up(size, 32 if size <= 128 else 64) * 4
    if hk != h:
        held += 2 * b * lk * h * d * q.element_size()
    return held + _copied_unless_blhd(grad_out) + _copied_unless_blhd(out)


def _efficient_backward(node: fx.Node) -> int:
    """What the memory-efficient backward holds beyond its results (estimated from its kernel's sources, checked
    where a GPU is present): the rows' delta, the fp32 dQ accumulator, a dense copy of the output's gradient."""
    grad_out, q = _val(node, 0), _val(node, 1)
    b, h, lq, d = q.shape
    return b * h * lq * 4 + b * h * lq * d * 4 + _copied_unless_blhd(grad_out)


def workspaces(device: torch.device) -> dict[object, Callable[[fx.Node], int]]:
    """The attention kernels' workspaces on `device`, for the tracer (`TrainGraph.workspaces`); none on the CPU,
    whose kernels remat does not choose."""
    if device.type != "cuda":
        return {}
    return {FLASH_BACKWARD: functools.partial(_flash_backward, devices.sm_count(device)),
            EFFICIENT_BACKWARD: _efficient_backward}
