"""Alias analysis from op schemas: which nodes are views, which write in place, and roots.

A schema marks an argument that a result aliases (`Tensor(a) self -> Tensor(a)`: a
view) and an argument that the op writes (`Tensor(a!) self`: in place). A root is the
node whose output owns the memory that a chain of views and in-place results shares.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
from torch import fx

from remat.graph import tensors_in


def schema(node: fx.Node) -> torch.FunctionSchema | None:
    target = node.target
    return target._schema if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def _bound_args(node: fx.Node, s: torch.FunctionSchema) -> list[tuple[torch.Argument, Any]]:
    bound: list[tuple[torch.Argument, Any]] = list(zip(s.arguments, node.args))
    bound += [(a, node.kwargs[a.name]) for a in s.arguments[len(node.args):] if a.name in node.kwargs]
    return bound


def written(node: fx.Node) -> list[fx.Node]:
    """The inputs that `node` writes in place (empty for functional ops)."""
    s = schema(node)
    if s is None:
        return []
    return [n for a, v in _bound_args(node, s) if a.alias_info and a.alias_info.is_write
            for n in tensors_in(v) if isinstance(n, fx.Node)]


def view_source(node: fx.Node) -> fx.Node | None:
    """The input whose memory `node`'s result shares without writing it (a view), if any."""
    if node.op == "call_function" and node.target is operator.getitem:
        parent = node.args[0]
        return view_source(parent) if isinstance(parent, fx.Node) else None
    s = schema(node)
    if s is None or not any(r.alias_info and not r.alias_info.is_write for r in s.returns):
        return None
    for a, v in _bound_args(node, s):
        if a.alias_info and not a.alias_info.is_write and isinstance(v, fx.Node):
            return v
    return None


def is_mutating(node: fx.Node) -> bool:
    s = schema(node)
    return s is not None and s.is_mutable


def is_random(node: fx.Node) -> bool:
    """Draws random numbers: a seeded op, unless its dropout probability is zero (attention)."""
    s = schema(node)
    if s is None or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    p = [a for a in s.arguments if a.name == "dropout_p"]
    return not p or bool(node.kwargs.get("dropout_p", dict(_bound_args(node, s)).get(p[0], p[0].default_value)) != 0)


def roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node's root: follow views to their source and in-place results to what they write."""
    root: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        src = view_source(n)
        if src is None and (w := written(n)):
            src = w[0]
        root[n] = root.get(src, src) if src is not None else n
    return root


def writes_by_root(graph: fx.Graph, root: dict[fx.Node, fx.Node]) -> dict[fx.Node, list[int]]:
    """Graph positions of the in-place writes to each root, in order."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    out: dict[fx.Node, list[int]] = defaultdict(list)
    for n in graph.nodes:
        for w in written(n):
            out[root[w]].append(pos[n])
    return out


def reads(node: fx.Node, root: dict[fx.Node, fx.Node]) -> set[fx.Node]:
    """Roots whose memory `node` reads: its tensor inputs', and its own when it is a view or the root."""
    return {root[a] for a in node.all_input_nodes} | {root[node]}
