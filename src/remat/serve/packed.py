"""Decoding from the stored blocks: a GGUF's quantized Linear weights repacked for PyTorch's CPU int4 kernel.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)` multiplies bfloat16 rows by a
weight of 4-bit integers in its own packed layout, one (scale, zero) pair per group of 32 along a row, each
weight read as `(q - 8) * scale + zero`. Every block type whose weight is an integer times a scale plus an
offset per group of 32 says so (`integers`: q, scale, offset; w = q * scale + offset) and is packed:

- q in 0..15 (Q4_1, Q4_K): one 4-bit product, zero = offset + 8 * scale;
- q in -8..7 (Q4_0): one product, q + 8, zero = offset;
- wider q (Q5_*, Q5_K, Q8_0: -128..127): q = 16 * hi + lo, hi in -8..7 and lo in 0..15, as two products in one
  call over the row repeated twice: [hi | lo] along K, scales (16 * scale, offset) and (scale, 8 * scale).

The kernel takes bfloat16 scales and zeros: a scale rounds to bfloat16 (8 bits of mantissa, from float16's 11),
and so does a zero; Q4_1's zero is m + 8d, a sum rounded once, so it differs from d * q + m by up to 2^-9 of
|m + 8d| (`tests/test_packed.py` states the tolerances). Types the kernel cannot express (Q6_K's groups of 16,
float16 / bfloat16 / float32 weights) are made float32 once, at load.

Many rows at once (a prompt's chunk) go the other way: from `DENSE_ROWS` rows (by type, measured: ~128 for Q4_1)
the layer dequantizes its weight from the blocks to bfloat16 and multiplies densely (`Packed.dense`), bfloat16
products as the kernel's, each weight rounded once. A 512-token prompt of the default model prefilled in 2.7 s at
one thread this way, 4.1 s through the kernel alone, 3.7 s from float32 weights (`--weights float32`).

A packed layer keeps its stored weight (its bytes under `remat.models.stored.Stored`) and only its forward
changes: reading `.weight` still gives the float weight, PEFT wraps the layer by its name as before and its
adapters add their float32 product to the packed one. The packed copy is the serving copy's bytes
(`Packed.nbytes`): the Engine reports them. An embedding stored in blocks (a tied Q8_0 head's) looks its rows up
in the blocks as it does in training (`stored.look_up_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch
from torch import nn
from torch.nn.utils import parametrize

from remat.models import quant, stored

Q = gguf.GGMLQuantizationType
GROUP = 32
INT4MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
PACK = torch.ops.aten._convert_weight_to_int4pack_for_cpu

__all__ = ["PACKABLE", "Packed", "integers", "pack", "pack_model"]


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: each of the 8 groups' scale d * sc and offset -dmin * m, [blocks, 8, 1]."""
    d, dmin = quant._half(b[:, :2]).unsqueeze(-1), quant._half(b[:, 2:4]).unsqueeze(-1)
    sc, mn = quant._scale_min_k4(b[:, 4:16])
    return d * sc, -(dmin * mn)


def _integers(qtype: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks [n, size] -> (q [n, block] int32, scale [n, block / 32], offset [n, block / 32]) float32."""
    n = b.shape[0]
    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
        d = quant._half(b[:, :2])
        if qtype == Q.Q8_0:
            q = b[:, 2:].view(torch.int8).to(torch.int32)
        elif qtype == Q.Q4_0:
            q = quant._nibbles(b[:, 2:]).to(torch.int32) - 8
        else:
            q = quant._five_bits(b[:, 2:6], b[:, 6:]).to(torch.int32) - 16
        return q, d, torch.zeros_like(d)
    if qtype in (Q.Q4_1, Q.Q5_1):
        dm = quant._half(b[:, :4])
        raw = quant._nibbles(b[:, 4:]) if qtype == Q.Q4_1 else quant._five_bits(b[:, 4:8], b[:, 8:])
        return raw.to(torch.int32), dm[:, :1].contiguous(), dm[:, 1:].contiguous()
    scale, offset = _k_scales(b)
    q = quant._k_sub_blocks(b[:, 16:] if qtype == Q.Q4_K else b[:, 48:])
    if qtype == Q.Q5_K:
        qh = b[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4)
    return q.to(torch.int32).reshape(n, -1), scale.reshape(n, -1), offset.reshape(n, -1)


# the types `integers` expresses, and the range of their q
PACKABLE = {Q.Q4_0: (-8, 7), Q.Q4_1: (0, 15), Q.Q4_K: (0, 15), Q.Q5_0: (-16, 15), Q.Q5_1: (0, 31),
            Q.Q5_K: (0, 31), Q.Q8_0: (-128, 127)}


def integers(qtype: int, blocks: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """A stored weight of `shape` [N, K] as (q [N, K] int32, scale [N, K/32], offset [N, K/32]) float32: the
    weight is q * scale + offset, each scale and offset shared by a group of 32 along a row."""
    if qtype not in PACKABLE:
        raise ValueError(f"{Q(qtype).name} weights are not integers in groups of 32")
    size = gguf.GGML_QUANT_SIZES[Q(qtype)][1]
    q, scale, offset = _integers(qtype, blocks.reshape(-1, size))
    n, k = shape
    return q.reshape(n, k), scale.reshape(n, k // GROUP), offset.reshape(n, k // GROUP)


# From how many rows a layer dequantizes its weight and multiplies densely in bfloat16 (a prompt's chunk) rather
# than through the int4 kernel (decoding: a row per sequence), by type: where the measured times cross. Measured
# (`python -m remat.bench.packed_rows`) on this project's 2-core x86 machine at one thread, ms per product,
# int4 kernel / dense (dequantized in bfloat16 + matmul):
#   rows               1            16           64           128          192          512
#   Q4_1 576x576     0.02 / 0.56  0.13 / 0.58  0.50 / 0.72  0.99 / 0.91  1.50 / 1.16  4.04 / 2.26
#   Q4_1 1536x576    0.06 / 1.20  0.33 / 1.51  1.33 / 2.86  3.11 / 2.90  4.23 / 2.97  10.7 / 6.35
#   Q4_1 576x1536    0.05 / 1.33  0.33 / 1.29  1.31 / 1.99  2.62 / 3.47  4.04 / 3.26  10.8 / 5.97
#   Q8_0 49152x576   3.33 / 18.7  22.5 / 23.6  91.6 / 45.8  185 / 65.6   275 / 85.4   802 / 195
# and at 576x1536 the crossing of each type: Q4_0 ~96 rows, Q4_1 ~128, Q4_K ~160, Q5_0 ~96, Q5_1 ~96, Q5_K ~80,
# Q8_0 ~20 (a cheap dequantization, and two products in the kernel: hi and lo). A prompt of 512 tokens runs the
# Q4_1 layers 1.5-2x faster dense. The head (49152x576) dequantized whole spilled the cache (147 ms, Q8_0), hence
# `CHUNK` rows at a time (19 ms).
DENSE_ROWS = {Q.Q4_0: 96, Q.Q4_1: 128, Q.Q4_K: 160, Q.Q5_0: 96, Q.Q5_1: 96, Q.Q5_K: 80, Q.Q8_0: 24}
CHUNK = 2048  # weight rows dequantized at a time by the dense path


@dataclass
class Packed:
    """A weight [N, K] in the int4 kernel's layout: `packed` uint8 [N, parts * K / 2], `scales_and_zeros`
    bfloat16 [parts * K / 32, N, 2]; `parts` 2 when the row is multiplied twice (hi and lo). `blocks`: the stored
    weight it was packed from (the same tensor, not a copy), which the dense path dequantizes."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    parts: int
    out_features: int
    blocks: torch.Tensor
    qtype: int
    dense_rows: int  # DENSE_ROWS of its type

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (any float dtype) @ W^T -> [..., N] in x's dtype, computed in bfloat16: through the int4
        kernel below `DENSE_ROWS[qtype]` rows, from there by the dequantized weight (`dense`)."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if rows.shape[0] >= self.dense_rows:
            y = self.dense(rows)
        elif self.parts == 1:  # the kernel's call inline: a decode token makes 211 of these (SmolLM2)
            y = INT4MM(rows, self.packed, GROUP, self.scales_and_zeros)
        else:
            y = self.kernel(rows)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """bfloat16 rows [M, K] @ W^T by the int4 kernel (W read as (q4 - 8) * scale + zero, both bfloat16)."""
        if self.parts == 2:
            rows = torch.cat((rows, rows), dim=1)
        return INT4MM(rows, self.packed, GROUP, self.scales_and_zeros)

    def dense(self, rows: torch.Tensor) -> torch.Tensor:
        """bfloat16 rows [M, K] @ W^T by W dequantized from its blocks to bfloat16 (each weight rounded once,
        as exact as the kernel's or more), `CHUNK` rows of W at a time."""
        k = rows.shape[1]
        blocks = self.blocks.reshape(self.out_features, -1)
        parts = [rows @ torch.ops.remat.dequantize(blocks[s:s + CHUNK], self.qtype,
                                                   (min(CHUNK, self.out_features - s), k), torch.bfloat16).T
                 for s in range(0, self.out_features, CHUNK)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def pack(qtype: int, blocks: torch.Tensor, shape: tuple[int, int]) -> Packed:
    """The int4 kernel's copy of a stored weight of `shape` [N, K] (K a multiple of 32)."""
    q, scale, offset = integers(qtype, blocks, shape)
    lo, hi = PACKABLE[Q(qtype)]
    if hi <= 15 and lo >= 0:
        parts, q4, scales, zeros = 1, q, scale, offset + 8 * scale
    elif lo >= -8 and hi <= 7:
        parts, q4, scales, zeros = 1, q + 8, scale, offset
    else:  # q = 16 * (q >> 4) + (q & 15): [hi | lo] along the row, the row multiplied twice
        parts = 2
        q4 = torch.cat(((q >> 4) + 8, q & 15), dim=1)
        scales, zeros = torch.cat((16 * scale, scale), dim=1), torch.cat((offset, 8 * scale), dim=1)
    packed = PACK(q4.contiguous(), 1)
    sz = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return Packed(packed, sz, parts, shape[0], blocks, int(qtype), DENSE_ROWS[Q(qtype)])


def _linear_forward(layer: nn.Linear, weight: Packed):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return weight.mm(x) + layer.bias
    return forward


def _plain(module: nn.Module, cls: type) -> bool:
    """The module is a `cls` with its own forward (parametrize makes a subclass of the module's class)."""
    base = type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)
    return base is cls


def pack_model(model: nn.Module) -> dict[str, int]:
    """Serve `model`'s stored weights from their blocks, in place: each Linear of a packable type computes with
    its packed copy, each stored embedding looks its rows up in the blocks, and every other stored weight is
    made float32 once. Returns {"packed": bytes of the packed copies, "layers": how many, "float": bytes made
    float32}. A model without stored weights is left as it is."""
    copies: dict[int, Packed] = {}
    out = {"packed": 0, "layers": 0, "float": 0}
    left: list[tuple[nn.Module, torch.Tensor]] = []
    for module in model.modules():
        try:
            s, blocks = stored.stored_of(module)
        except KeyError:
            continue
        if (isinstance(module, nn.Linear) and _plain(module, nn.Linear) and s.qtype in PACKABLE
                and module.in_features % GROUP == 0):
            if id(blocks) not in copies:
                copies[id(blocks)] = pack(s.qtype, blocks, (module.out_features, module.in_features))
                out["packed"] += copies[id(blocks)].nbytes
            weight = copies[id(blocks)]  # without a bias, the layer's forward is the product's
            module.forward = weight.mm if module.bias is None else _linear_forward(module, weight)  # type: ignore[method-assign]
            out["layers"] += 1
        elif getattr(module.forward, "__func__", None) is stored.look_up_rows:
            pass  # made row by row as looked up
        else:
            left.append((module, blocks))
    out["float"] = _make_float(left)
    return out


def _make_float(modules: list[tuple[nn.Module, torch.Tensor]]) -> int:
    """Make these modules' stored weights plain float32 parameters (ties stay tied); their bytes."""
    floats: dict[int, nn.Parameter] = {}
    for module, blocks in modules:
        if id(blocks) not in floats:
            weight = module.weight
            assert isinstance(weight, torch.Tensor)  # a stored weight reads as its float tensor
            with torch.no_grad():
                floats[id(blocks)] = nn.Parameter(weight.float(), requires_grad=False)
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        module.weight = floats[id(blocks)]
    return sum(p.nbytes for p in floats.values())
