"""Marks: a named identity op that tags a tensor in the traced graph.

`remat::mark(x, "l_out.7")` is JAX's `checkpoint_name` for PyTorch: the rewrite keeps
every node whose mark starts with the kept prefix (`remat.models.hf` marks each layer's output).
Marks survive `make_fx` because they are a real op with fake and autograd kernels.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("remat::mark", mutates_args=())
def mark(x: torch.Tensor, name: str) -> torch.Tensor:
    # A custom op may not return an alias of its input, so the identity is a copy:
    # the unmarked original then dies at once and only the mark lives on.
    return x.clone()


@mark.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor):
    return grad, None


mark.register_autograd(_backward)

MARK_OP = torch.ops.remat.mark.default
LAYER_MARK = "l_out"  # each decoder layer's output (the residual stream) is marked `l_out.{i}`


def mark_name(node: torch.fx.Node) -> str | None:
    """The mark name of a graph node, or None when it is not a mark."""
    if node.op != "call_function" or node.target is not MARK_OP:
        return None
    name = node.args[1]
    assert isinstance(name, str)
    return name
