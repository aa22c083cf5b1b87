"""The recompute rewrite: keep one mark per layer (`l_out`), recompute the rest before backward.

Rules (docs/architecture.md, "The rewrite"), all in this file:
1. saved: forward nodes that some backward node reads.
2. kept (never recomputed), the mandatory rules (`must_keep`): placeholders; the step's
   outputs (the loss lives to the end anyway, and the backward's seed reads it); random ops;
   ops that write in place or have side effects; and any node that reads a root buffer
   (directly or through views) which an in-place op writes later in the graph: recomputed in
   backward, it would read the advanced value. Then the policy (`remat.policies`) keeps what
   it saves: by default one `l_out` mark per layer.
3. every saved, non-kept node is replaced, for its backward users, by a memoised clone
   computed from kept nodes, placed just before its first backward consumer; clones
   placed before one consumer go in their original forward order.
4. outputs untouched: the same values, bitwise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx

from remat import alias
from remat.capture import fake_values
from remat.graph import TrainGraph, interpret, tensors_in
from remat.marks import mark_name
from remat.policies import Policy, layer_marks

CLONE_OF = "remat_clone_of"  # node.meta key: the original a clone recomputes
LAYER = layer_marks()  # `on`: one mark per layer


def must_keep(tg: TrainGraph) -> dict[fx.Node, str]:
    """The forward nodes that exactness forbids recomputing, with why. These rules always win."""
    graph = tg.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    root = alias.roots(graph)
    writes = alias.writes_by_root(graph, root)
    outputs = set(next(n for n in reversed(graph.nodes) if n.op == "output").all_input_nodes)
    reasons: dict[fx.Node, str] = {}
    for n in tg.forward_nodes():
        if n.op != "call_function":
            reasons[n] = n.op  # placeholder, get_attr
        elif n in outputs:
            reasons[n] = "output"
        elif alias.is_random(n):
            reasons[n] = "random"
        elif alias.is_mutating(n):
            reasons[n] = "in-place"
        elif any(w > pos[n] for r in alias.reads(n, root) for w in writes.get(r, ())):
            reasons[n] = "reads-mutated-root"
    return reasons


def keep_reasons(tg: TrainGraph, policy: Policy = LAYER) -> dict[fx.Node, str]:
    """Every forward node that is not recomputed, with why: a mandatory rule, else the policy's name."""
    reasons = must_keep(tg)
    for n in tg.forward_nodes():
        if n not in reasons and policy.saves(n):
            reasons[n] = policy.name
    return reasons


def saved_nodes(tg: TrainGraph) -> list[fx.Node]:
    fwd = tg.forward_set()
    return [n for n in tg.forward_nodes() if any(u not in fwd for u in n.users)]


def rewrite(tg: TrainGraph, policy: Policy = LAYER) -> TrainGraph:
    """A new TrainGraph whose backward reads only kept forward nodes and recompute clones."""
    kept = keep_reasons(tg, policy)
    forward = tg.forward_nodes()
    fwd_index = {n: i for i, n in enumerate(forward)}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}  # original -> its copy in the new graph
    clones: dict[fx.Node, fx.Node] = {}  # original forward node -> its recompute clone

    for n in forward:
        env[n] = new.node_copy(n, env.__getitem__)

    def recomputed(n: fx.Node) -> fx.Node:
        return env[n] if n in kept else clones[n]

    def needed(n: fx.Node, acc: set[fx.Node]) -> None:
        # the not-yet-cloned, non-kept forward ancestors of n (n included)
        stack = [n]
        while stack:
            m = stack.pop()
            if m in kept or m in clones or m in acc:
                continue
            acc.add(m)
            stack.extend(m.all_input_nodes)

    for n in list(tg.graph.nodes)[len(forward):]:
        todo: set[fx.Node] = set()
        for a in n.all_input_nodes:
            if a in fwd_index:
                needed(a, todo)
        for m in sorted(todo, key=fwd_index.__getitem__):
            clones[m] = new.node_copy(m, recomputed)
            clones[m].meta[CLONE_OF] = m.name
        env[n] = new.node_copy(n, lambda a: recomputed(a) if a in fwd_index else env[a])

    new.lint()
    gm = fx.GraphModule(tg.gm, new)
    fake_values(_fresh(new, set(clones.values())))
    boundary = env[tg.boundary]
    return TrainGraph(gm=gm, roles=tg.roles, names=tg.names, boundary=boundary,
                      info={**tg.info, "recompute": policy.name})


def _fresh(graph: fx.Graph, clones: set[fx.Node]) -> list[fx.Node]:
    """The nodes that need values of their own, in graph order: the clones (each its own storage) and
    whatever views or writes a clone (it shares the clone's storage, not the original's)."""
    fresh: list[fx.Node] = []
    seen = set(clones)
    for n in graph.nodes:
        if n in clones or any(s in seen for s in (alias.view_source(n), *alias.written(n))):
            seen.add(n)
            fresh.append(n)
    return fresh


@dataclass
class Explanation:
    kept: dict[str, str]  # saved node name -> reason it is kept
    counts: dict[str, Counter]  # reason -> op counts, over saved kept nodes
    recomputed: Counter  # op counts of the saved nodes that get recomputed

    def format(self) -> str:
        lines = [f"kept across the backward: {len(self.kept)} nodes"]
        for reason, ops in sorted(self.counts.items()):
            lines.append(f"  {reason}: {sum(ops.values())}")
            lines += [f"    {op}: {c}" for op, c in ops.most_common()]
        lines.append(f"recomputed: {sum(self.recomputed.values())} nodes")
        lines += [f"    {op}: {c}" for op, c in self.recomputed.most_common()]
        return "\n".join(lines)


def _op(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_function" else n.op


def explain(tg: TrainGraph, policy: Policy = LAYER) -> Explanation:
    """What the rewrite keeps alive into the backward (and why), and what it recomputes."""
    reasons = keep_reasons(tg, policy)
    kept: dict[str, str] = {}
    counts: dict[str, Counter] = {}
    recomputed: Counter = Counter()
    for n in saved_nodes(tg):
        if n in reasons:
            kept[n.name] = reasons[n]
            counts.setdefault(reasons[n], Counter())[_op(n)] += 1
        else:
            recomputed[_op(n)] += 1
    return Explanation(kept, counts, recomputed)


@dataclass
class Difference:
    node: str
    op: str
    mark: str | None  # the layer: the first mark at or after the original in forward order
    shape: list[int]
    max_abs_diff: float


@dataclass
class VerifyResult:
    clones: int
    first_difference: Difference | None

    @property
    def equal(self) -> bool:
        return self.first_difference is None


def verify(tg: TrainGraph, args: list[torch.Tensor]) -> VerifyResult:
    """Run a rewritten graph, comparing each clone with its original (kept alive for it)."""
    nodes = {n.name: n for n in tg.graph.nodes}
    pairs = {n: nodes[n.meta[CLONE_OF]] for n in tg.graph.nodes if CLONE_OF in n.meta}
    next_mark, upcoming = {}, None
    for n in reversed(tg.forward_nodes()):
        upcoming = mark_name(n) or upcoming
        next_mark[n] = upcoming
    first: list[Difference] = []

    def check(node: fx.Node, value: object, env: dict) -> None:
        if node not in pairs or first:
            return
        original = env[pairs[node]]
        for a, b in zip(tensors_in(value), tensors_in(original)):
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")
                first.append(Difference(node.name, _op(node), next_mark[pairs[node]], list(a.shape), diff))
                return

    interpret(tg.gm, args, on_node=check, keep=set(pairs.values()))
    return VerifyResult(len(pairs), first[0] if first else None)
