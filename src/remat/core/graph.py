"""The TrainGraph contract: a traced train step, the tensors it takes, and a node-by-node runner.

`gm(*trainable, *frozen, *buffers, *inputs) -> (loss, *grads)`: placeholders in that
order, one role each (see docs/architecture.md, "The TrainGraph contract").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from remat.core.marks import mark_name

ROLES = ("trainable", "frozen", "buffer", "input", "state")


def tensors_in(value: object) -> list:
    """The leaves of a (nested) tuple or list that are tensors, or fx nodes: one pytree walk for both."""
    if isinstance(value, (torch.Tensor, fx.Node)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def laid_out_on(t: torch.Tensor, storage: torch.UntypedStorage, offset: int | torch.SymInt) -> torch.Tensor:
    """A value laid out as `t` (shape, strides, dtype) on `storage` at `offset`: a meta tensor, which holds all
    a plan reads (not its device). Not a FakeTensor: made as one, a value cost five times as much (55 µs
    against 11), a third of stamping a step."""
    return torch.empty(0, dtype=t.dtype, device="meta").set_(storage, offset, t.shape, t.stride())


def new_node(graph: fx.Graph, op: str, target: Any, args: tuple = (), kwargs: dict | None = None,
             name: str | None = None, type_expr: Any = None) -> fx.Node:
    """`graph.create_node(...)` without its walk over every argument for a raw SymInt, which only warns and
    which remat's graphs never hold (their sizes are concrete): a fifth of stamping a step, as measured."""
    node = graph.create_node(op, target, name=name, type_expr=type_expr)
    # past `Node.__setattr__`, which files the node again in the graph's table by (op, target) on every
    # attribute set, though neither changes here (with `copy_node`'s meta: a sixth of stamping a step)
    if args:
        object.__setattr__(node, "args", args)
    if kwargs:
        object.__setattr__(node, "kwargs", kwargs)
    return node


def copy_node(graph: fx.Graph, node: fx.Node, read: Callable[[fx.Node], Any]) -> fx.Node:
    """`graph.node_copy(node, read)`, by `new_node`."""
    copied = new_node(graph, node.op, node.target, fx.map_arg(node.args, read), fx.map_arg(node.kwargs, read),
                      node.name, node.type)
    copied.meta.update(node.meta)  # a new node's own (empty) dict: no attribute set (`new_node`)
    return copied


# Ops that hold memory inside beyond their outputs while they run (a backward that recomputes its forward:
# `remat.models.delta_rule`): op -> the bytes it holds at its peak beyond its outputs, from the node's fake values.
# The tracer of a step that swaps such ops in hands them over (`capture.trace`); the planner adds them at the node.
Workspaces = Mapping[object, Callable[[fx.Node], int]]


@dataclass
class TrainGraph:
    """A traced train step: `gm(*trainable, *frozen, *buffers, *inputs) -> (loss, *grads)`."""

    gm: fx.GraphModule
    roles: list[str]  # one per placeholder, in order: see ROLES
    names: list[str]  # one per placeholder: parameter / buffer / input name
    boundary: fx.Node  # the last forward node
    info: dict = field(default_factory=dict)  # options the graph was traced with
    workspaces: Workspaces = field(default_factory=dict)  # its ops' memory held inside (planned at their nodes)

    def workspace(self, node: fx.Node) -> int:
        """What `node` holds while it runs beyond its value."""
        fn = self.workspaces.get(node.target) if node.op == "call_function" else None
        return fn(node) if fn is not None else 0

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def forward_nodes(self) -> list[fx.Node]:
        nodes = []
        for n in self.graph.nodes:
            nodes.append(n)
            if n is self.boundary:
                return nodes
        raise AssertionError("boundary node is not in the graph")

    def forward_set(self) -> set[fx.Node]:
        return set(self.forward_nodes())

    def marks(self) -> dict[fx.Node, str]:
        return {n: name for n in self.graph.nodes if (name := mark_name(n)) is not None}

    def make_code(self) -> None:
        """Make the graph's Python code now, not on its first call (graphs are traced lazy: one only planned
        never needs it), where the memory it takes is measured (`train`: the plans' `trace`)."""
        _LazyGraphModule.force_recompile(self.gm)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():  # the backward is in the graph: autograd must not record it again
            loss, *grads = self.gm(*args)
        return loss, grads


@dataclass
class StepInputs:
    """The model's tensors split by role, in the placeholder order of the traced graph."""

    trainable: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> StepInputs:
        trainable: dict[str, torch.Tensor] = {}
        frozen: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():  # tied weights appear once
            (trainable if p.requires_grad else frozen)[name] = p
        return cls(trainable, frozen, dict(model.named_buffers()))

    def args(self, *batch: torch.Tensor) -> list[torch.Tensor]:
        return [*self.trainable.values(), *self.frozen.values(), *self.buffers.values(), *batch]


@torch.no_grad()  # the backward is in the graph: autograd must not record it again
def interpret(gm: fx.GraphModule, args: list, *, on_node=None, on_free=None,
              keep: set[fx.Node] | frozenset = frozenset()) -> list:
    """Run `gm` node by node, freeing each value after its last use (unless in `keep`).

    `on_node(node, value, env)` sees every value as it is made, `on_free(node, value)` as
    it is dropped. This is the slow path used to observe a run (measured memory, verify
    mode); training calls `gm` itself, which frees values at the same points.
    """
    def drop(n: fx.Node) -> None:
        value = env.pop(n)
        if on_free is not None:
            on_free(n, value)

    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    dies_at: dict[int, list[fx.Node]] = {}
    for n, i in last_use.items():
        if n not in keep:
            dies_at.setdefault(i, []).append(n)
    env: dict[fx.Node, Any] = {}
    it = iter(args)
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "output":
            return list(fx.node.map_arg(n.args[0], env.__getitem__))
        else:
            a, kw = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            if n.op == "call_module":
                env[n] = gm.get_submodule(n.target)(*a, **kw)
            else:
                env[n] = getattr(gm, n.target) if n.op == "get_attr" else n.target(*a, **kw)
        if on_node is not None:
            on_node(n, env[n], env)
        if not n.users and n not in keep:
            drop(n)
        for dead in dies_at.get(i, ()):
            drop(dead)
    raise AssertionError("graph has no output")
