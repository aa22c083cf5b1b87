"""Dequantization of GGUF blocks in torch ops, as one op of the traced step: `remat::dequantize`.

A frozen weight stays in memory as the file stores it (`remat.models.stored`): a uint8 tensor of whole
rows of blocks, `[..., row bytes]`, the layout of ggml and of gguf-py's reader, so a serving kernel can read
the blocks themselves. Reading the weight runs `remat::dequantize(blocks, qtype, shape, dtype)`: one node per
weight in a traced step, with a fake kernel, so a plan sees the float copy's bytes where the step holds it.

The kernels are gguf-py's `gguf.quants.dequantize`, bit for bit (`tests/test_quant.py`): the same float32
operations in the same order, NaN payloads included. Two places needed care: the CPU's half to float
conversion (torch's) quiets a signalling NaN where numpy keeps its bits, so NaN scales are converted by their
bits; and a product's NaN payload depends on its operand order, which follows gguf-py's.

On a CPU the block types are made by the compiled kernels first (`remat.models.native`: the same values in one
pass); these torch kernels make the rest (F16, BF16, F32; scales that are not finite; other devices; a machine
without a C compiler).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gguf
import torch

from remat.core import policies
from remat.models import native

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K

__all__ = ["DEQUANTIZE", "KEPT", "dequantize", "row_bytes", "stored_bytes"]


def row_bytes(qtype: int, row: int) -> int:
    """Bytes of one row of `row` elements stored as `qtype` (ValueError when the row does not fill whole blocks)."""
    block, size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    if row % block:
        raise ValueError(f"a row of {row} elements is not a whole number of {Q(qtype).name} blocks of {block}")
    return row // block * size


def stored_bytes(qtype: int, shape: Sequence[int]) -> int:
    """Bytes a tensor of `shape` takes stored as `qtype` (its rows are its last dimension)."""
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return rows * row_bytes(qtype, shape[-1])


# -------------------------------------------------------------------------------------------- the kernels


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2k] (little-endian halves) -> float32 [n, k], as numpy converts them."""
    raw = b.contiguous().view(torch.int16)
    f = raw.view(torch.float16).float()
    nan = f.isnan()
    if nan.any():  # numpy keeps a NaN's bits (sign, payload), signalling or not; the CPU's conversion quiets it
        h = raw[nan].to(torch.int32)
        f[nan] = (((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)).view(torch.float32)
    return f


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32).clone()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] (k a multiple of 4) -> [n, 2k]: each row's low nibbles, then its high ones. Four bytes at a
    time, as int32: a byte's high nibble shifted down is masked clear of the next byte's bits (1.6x the bytewise
    masks into a strided output)."""
    x = qs.contiguous().view(torch.int32)
    return torch.cat((x & 0x0F0F0F0F, (x >> 4).bitwise_and_(0x0F0F0F0F)), dim=1).view(torch.uint8)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> its 32 bits, bit j at column j, as uint8 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _sum(a: torch.Tensor, b: torch.Tensor, alpha: int = 1) -> torch.Tensor:
    """`a + alpha * b` in place, b broadcast per block. Where both are NaN, numpy's result is a's NaN; torch's
    vectorised add computes `alpha * b + a` and keeps b's. So the blocks where b has a NaN (its scales not finite:
    a corrupt or adversarial file) are redone by that rule; where it has none (every sound file) the check costs
    two small ops."""
    nan = b.isnan()
    if not nan.any():
        return a.add_(b, alpha=alpha)
    odd = nan.reshape(len(nan), -1).any(1).nonzero().squeeze(1)
    first = a[odd]
    a.add_(b, alpha=alpha)
    a[odd] = torch.where(first.isnan(), first, a[odd])
    return a


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, :2])
    return _nibbles(b[:, 2:]).float().sub_(8).mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    dm = _half(b[:, :4])  # d and m, side by side
    d, m = dm[:, :1], dm[:, 1:]
    return _sum(_nibbles(b[:, 4:]).float().mul_(d), m)  # (d * q) + m


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _nibbles(qs).bitwise_or_(_high_bits(qh) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, :2])
    return _five_bits(b[:, 2:6], b[:, 6:]).float().sub_(16).mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    dm = _half(b[:, :4])
    d, m = dm[:, :1], dm[:, 1:]
    return _sum(_five_bits(b[:, 4:8], b[:, 8:]).float().mul_(d), m)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, :2])
    return b[:, 2:].view(torch.int8).float().mul_(d)  # x * d


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K), as floats [n, 8, 1]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _k_sub_blocks(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of nibbles -> the 8 sub-blocks of 32 (each 32 bytes' low nibbles, then their high ones)."""
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(n, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _half(b[:, :2]).unsqueeze(-1), _half(b[:, 2:4]).unsqueeze(-1)
    sc, mn = _scale_min_k4(b[:, 4:16])
    q = _k_sub_blocks(b[:, 16:]).float().mul_(d * sc)
    return _sum(q, dmin * mn, -1).reshape(-1, QK_K)  # (d * sc) * q - dmin * m


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _half(b[:, :2]).unsqueeze(-1), _half(b[:, 2:4]).unsqueeze(-1)
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    q = (_k_sub_blocks(b[:, 48:]) | ((qh & 1) << 4)).float().mul_(d * sc)
    return _sum(q, dmin * mn, -1).reshape(-1, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_half(b[:, 208:]) * scales).reshape(n, 16, 1)
    low = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).view(torch.int8).float().sub_(32)
    return (d * q.reshape(n, 16, 16)).reshape(n, QK_K)  # d * q


# Weights the torch kernels make into a narrower dtype: their float32 values (1 MiB) are cast while still in cache,
# and no float32 copy of the whole weight is made (SmolLM2's blocks into bfloat16, one thread: 0.19 s against 0.39
# made whole and cast). Into float32, a weight is made whole: in pieces, their calls cost more than they saved.
PIECE = 1 << 18
_KERNELS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32, Q.F16: _half, Q.BF16: _bf16, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
# The types kept as stored; any other is dequantized when its file is loaded (`remat.models.stored`).
KEPT = frozenset(Q(t) for t in _KERNELS)


# -------------------------------------------------------------------------------------------- the op


@torch.library.custom_op("remat::dequantize", mutates_args=())
def dequantize(blocks: torch.Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The weight of `shape` whose rows `blocks` (uint8, `[..., row bytes]`) store as `qtype`, in `dtype`."""
    if qtype not in _KERNELS:
        raise ValueError(f"no dequantization kernel for {Q(qtype).name}")
    size = gguf.GGML_QUANT_SIZES[Q(qtype)][1]
    if blocks.dtype != torch.uint8 or blocks.numel() != stored_bytes(qtype, shape):
        raise ValueError(f"{blocks.dtype} blocks of {blocks.numel()} bytes do not hold a {Q(qtype).name} "
                         f"tensor of shape {list(shape)}")
    rows, kernel = blocks.reshape(-1, size), _KERNELS[qtype]
    made = native.dequantize(rows, qtype, dtype)  # one pass, where this machine built the compiled kernels
    if made is not None:
        return made.reshape(shape)
    if dtype == torch.float32 or rows.device.type != "cpu":  # pieces are for a CPU's cache
        return kernel(rows).reshape(shape).to(dtype)
    out = rows.new_empty((len(rows), gguf.GGML_QUANT_SIZES[Q(qtype)][0]), dtype=dtype)
    step = max(1, PIECE // out.shape[1])
    for i in range(0, len(rows), step):
        out[i:i + step] = kernel(rows[i:i + step])
    return out.reshape(shape)


@dequantize.register_fake
def _(blocks: torch.Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return blocks.new_empty(shape, dtype=dtype)


DEQUANTIZE = torch.ops.remat.dequantize.default
# A weight made again from blocks costs little and holds a float copy: never saved for the backward.
policies.ALWAYS_RECOMPUTED.add(DEQUANTIZE)
