"""Alias analysis from op schemas: which nodes are views, which write in place, and roots.

A schema marks an argument that a result aliases (`Tensor(a) self -> Tensor(a)`: a
view) and an argument that the op writes (`Tensor(a!) self`: in place). A root is the
node whose output owns the memory that a chain of views and in-place results shares.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from typing import Any, NamedTuple

import torch
from torch import fx

from remat.core.graph import tensors_in


def _overload(node: fx.Node) -> torch._ops.OpOverload | None:
    target = node.target
    return target if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def schema(node: fx.Node) -> torch.FunctionSchema | None:
    op = _overload(node)
    return None if op is None else op._schema


class _Aliasing(NamedTuple):
    """What an op's schema says of its arguments, read once per op: (position, name) of those it writes, and
    of those its result views (empty unless a result is a view)."""

    writes: tuple[tuple[int, str], ...]
    views: tuple[tuple[int, str], ...]


@functools.cache
def _aliasing(op: torch._ops.OpOverload) -> _Aliasing:
    s = op._schema

    def where(write: bool) -> tuple[tuple[int, str], ...]:
        return tuple((i, a.name) for i, a in enumerate(s.arguments)
                     if a.alias_info is not None and a.alias_info.is_write == write)

    a_view = any(r.alias_info and not r.alias_info.is_write for r in s.returns)
    return _Aliasing(where(True), where(False) if a_view else ())


def _bound(node: fx.Node, at: tuple[tuple[int, str], ...]) -> list[Any]:
    """The node's arguments at those schema places, positional or by keyword, where given."""
    n = len(node.args)
    return [node.args[i] if i < n else node.kwargs[name] for i, name in at if i < n or name in node.kwargs]


def written(node: fx.Node) -> list[fx.Node]:
    """The inputs that `node` writes in place (empty for functional ops)."""
    op = _overload(node)
    if op is None:
        return []
    return [n for v in _bound(node, _aliasing(op).writes) for n in tensors_in(v) if isinstance(n, fx.Node)]


def view_source(node: fx.Node) -> fx.Node | None:
    """The input whose memory `node`'s result shares without writing it (a view), if any."""
    if node.op == "call_function" and node.target is operator.getitem:
        parent = node.args[0]
        return view_source(parent) if isinstance(parent, fx.Node) else None
    op = _overload(node)
    if op is None:
        return None
    return next((v for v in _bound(node, _aliasing(op).views) if isinstance(v, fx.Node)), None)


def is_mutating(node: fx.Node) -> bool:
    s = schema(node)
    return s is not None and s.is_mutable


def is_random(node: fx.Node) -> bool:
    """Draws random numbers: a seeded op, unless its dropout probability is zero (attention)."""
    s = schema(node)
    if s is None or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    p = next((i for i, a in enumerate(s.arguments) if a.name == "dropout_p"), None)
    if p is None:
        return True
    given = node.args[p] if p < len(node.args) else node.kwargs.get("dropout_p", s.arguments[p].default_value)
    return bool(given != 0)


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
