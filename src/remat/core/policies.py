"""What to save for the backward beyond what exactness requires: small, composable policies (JAX style).

The rewrite's mandatory rules (placeholders, outputs, random ops, in-place writes and their
readers; `recompute.must_keep`) always win. A policy only decides, for every other value the
backward reads, "save" (True) or "recompute" (False). Every policy gives the same losses and
grads bitwise: a recomputed value runs the same op on the same inputs.

Built-ins, from most memory (fastest) to least:
  off        save everything (no rewrite at all; with dequantized weights in the step, all but them)
  dots       save matrix-product outputs and the layer marks; recompute the cheap ops between them
  layer/on   save one `l_out` mark per decoder layer (the residual stream); recompute the rest
  offload    on a device: `on`, with the marks kept in pinned host memory until the backward (on the CPU: `on`)
  every:K    save every K-th layer mark; the marks between are recomputed once, as second-level
             checkpoints, and each layer's internals from the mark below it (Chen et al.'s sqrt(n)
             checkpointing: `recompute.rewrite`'s regions)
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from remat.core import alias
from remat.core.marks import LAYER_MARK, mark_name
from remat.core.precision import never_saved

# Matrix products: the values whose recompute costs the most per byte they hold.
DOTS = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.linear.default, torch.ops.aten.matmul.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten.convolution.default,
})

# Not views by their schema, but the same values laid out again: a product read through them is still saved.
RESHAPES = frozenset({torch.ops.aten._unsafe_view.default, operator.getitem})

SPEC = re.compile(r"off|on|layer|dots|offload|every:([1-9][0-9]*)")

# Ops whose values, and views made of them alone, no policy saves: recomputed from their inputs before the
# backward reads them, `off` included (a frozen weight dequantized from its blocks, `remat.models.quant`, whose
# float copy would otherwise live from the forward to the backward). Filled by the modules that define them.
ALWAYS_RECOMPUTED: set = set()


@dataclass(frozen=True)
class Policy:
    """A named predicate: `saves(node)` is True when the value is saved for the backward. `offloads(node)`, where
    given, names saved values a device's step keeps in host memory until the backward (JAX's
    `save_and_offload_only_these_names`; `remat.core.offload`)."""

    name: str
    saves: Callable[[fx.Node], bool]
    offloads: Callable[[fx.Node], bool] | None = None

    def __or__(self, other: Policy) -> Policy:
        moved = [p.offloads for p in (self, other) if p.offloads is not None]
        return Policy(f"{self.name}+{other.name}", lambda n: self.saves(n) or other.saves(n),
                      (lambda n: any(f(n) for f in moved)) if moved else None)


def layer_index(n: fx.Node, prefix: str = LAYER_MARK) -> int | None:
    """i for the layer mark `{prefix}.{i}`; None for any other node."""
    name = mark_name(n)
    if name is None or not name.startswith(prefix + "."):
        return None
    return int(name.rsplit(".", 1)[1])


def layer_marks(every: int = 1, prefix: str = LAYER_MARK) -> Policy:
    """Save the layer marks `{prefix}.{i}` with (i + 1) % every == 0."""

    def saves(n: fx.Node) -> bool:
        i = layer_index(n, prefix)
        return i is not None and (i + 1) % every == 0

    return Policy("layer" if every == 1 else f"every:{every}", saves)


def dots() -> Policy:
    """Save matrix-product outputs, also as the views the backward reads them through (a linear layer's
    `mm` is read as its `_unsafe_view`, attention's result as a `getitem`)."""

    def saves(n: fx.Node) -> bool:
        while n.op == "call_function" and n.target not in DOTS:
            source = n.args[0] if n.target in RESHAPES else alias.view_source(n)
            if not isinstance(source, fx.Node):
                return False
            n = source
        return n.op == "call_function"

    return Policy("dots", saves)


def always_recomputed(n: fx.Node) -> bool:
    """Whether the value is made by an op of `ALWAYS_RECOMPUTED` or is a cast no policy saves (a weight read in the
    compute dtype, an upcast: `precision.never_saved`), or is a view of one (a weight's transpose)."""
    while n.op == "call_function" and n.target not in ALWAYS_RECOMPUTED and not never_saved(n):
        source = n.args[0] if n.target in RESHAPES else alias.view_source(n)
        if not isinstance(source, fx.Node):
            return False
        n = source
    return n.op == "call_function"


def everything() -> Policy:
    """`off` where a step has values no policy saves (`always_recomputed`): all the rest is saved."""
    return Policy("off", lambda n: True)


def parse(spec: str) -> Policy | None:
    """A policy from its name (`layer`, `dots`, `every:4`, `on` = `layer`); None for `off`."""
    m = SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(f"unknown recompute policy {spec!r}: off, on, layer, dots, offload or every:K")
    if spec == "off":
        return None
    if spec == "dots":
        return dots() | layer_marks()
    if spec == "offload":
        return offload()
    return layer_marks(int(m[1]) if m[1] else 1)


def offload() -> Policy:
    """Save the layer marks, as `on`, and keep them in host memory on a device (on the CPU: `on`)."""
    marks = layer_marks()
    return Policy("offload", marks.saves, marks.saves)


def recompute_cost(n: fx.Node) -> float:
    """What recomputing a node costs: PyTorch's FLOP formula where it has one (matrix products, attention,
    convolutions), otherwise the output's size (elementwise and data movement, memory-bound)."""
    val = n.meta.get("val")
    numel = val.numel() if isinstance(val, torch.Tensor) else 0
    formula = flop_registry.get(getattr(n.target, "overloadpacket", None)) if n.op == "call_function" else None
    if formula is not None:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        try:
            return float(formula(*args, out_val=val, **kwargs))
        except (TypeError, ValueError, IndexError, AttributeError):  # a formula that wants other arguments
            pass
    return float(numel)
