"""Tied weights in a step that adds its grads into sums (`capture.trace`'s `accumulate`: the walk's chunks).

A tensor the model holds under several names (an embedding tied to the head) is one leaf: autograd sums the
gradients of all its uses before anyone sees them, so at the end of a chunk the head's gradient (summed over the
loss's pieces), the embedding's and their sum were alive together, each vocabulary x hidden (SmolLM2: 108 MiB,
three times). Here every call of a module that holds such a tensor reads a leaf of its own, whose gradient goes
into the sum the moment that call's backward makes it (`capture.into`), and nothing is summed first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter the model holds under several names: its first name (the one `StepInputs` lists) -> the
    names of every use (the first included)."""
    first: dict[int, str] = {}
    uses: dict[str, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        uses.setdefault(first.setdefault(id(t), name), []).append(name)
    return {name: names for name, names in uses.items() if len(names) > 1}


@contextlib.contextmanager
def each_use(model: nn.Module, hooks: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> Iterator[list]:
    """While on, each call of a module holding a tied parameter named in `hooks` (name -> gradient hook) swaps in
    a fresh leaf of the parameter's value, hooked; yields the list of those leaves, which the caller's backward
    must differentiate (they are not the parameter: its own gradient gets none of theirs)."""
    leaves: list[torch.Tensor] = []
    handles = []
    for name, uses in tied_names(model).items():
        if name in hooks:
            for use in uses:
                path, _, attr = use.rpartition(".")
                handles += _swapped(model.get_submodule(path), attr, hooks[name], leaves)
    try:
        yield leaves
    finally:
        for handle in handles:
            handle.remove()


def _swapped(module: nn.Module, attr: str, hook: Callable[[torch.Tensor], torch.Tensor], leaves: list) -> list:
    """Forward hooks on `module`: its parameter `attr` is a new hooked leaf for the call, and itself again after."""
    held: list[torch.Tensor] = []

    def before(m: nn.Module, args: object) -> None:
        held.append(m._parameters[attr])  # type: ignore[arg-type]  # a step's placeholder (functional_call's)
        leaf = held[-1].detach().requires_grad_()
        leaf.register_hook(hook)
        leaves.append(leaf)
        m._parameters[attr] = leaf  # type: ignore[assignment]

    def after(m: nn.Module, args: object, out: object) -> None:
        m._parameters[attr] = held.pop()  # type: ignore[assignment]

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
