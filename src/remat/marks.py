"""Marks: a named identity op that tags a tensor in the traced graph.

`remat::mark(x, "l_out.7")` is JAX's `checkpoint_name` for PyTorch: the rewrite keeps
every node whose mark starts with the checkpoint prefix. Marks survive `make_fx`
because they are a real op with fake and autograd kernels.
"""

from __future__ import annotations

import torch
from torch import nn


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


def mark_name(node: torch.fx.Node) -> str | None:
    """The mark name of a graph node, or None when it is not a mark."""
    return node.args[1] if node.op == "call_function" and node.target is MARK_OP else None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (PEFT-wrapped or not)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and module is not model:
            return layers
    raise ValueError(f"no decoder layers found in {type(model).__name__}")


def mark_layer_outputs(model: nn.Module, prefix: str = "l_out") -> list:
    """Mark each decoder layer's output hidden state `{prefix}.{i}`; returns the hook handles."""

    def hook(i: int):
        def fn(module, args, output):
            if isinstance(output, tuple):
                return (mark(output[0], f"{prefix}.{i}"), *output[1:])
            return mark(output, f"{prefix}.{i}")

        return fn

    return [layer.register_forward_hook(hook(i)) for i, layer in enumerate(decoder_layers(model))]
