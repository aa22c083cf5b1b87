"""The recompute rewrite: keep one mark per layer (`l_out`), recompute the rest before backward.

Rules (docs/architecture.md, "The rewrite"), all in this file:
1. saved: forward nodes that some backward node reads.
2. kept (never recomputed), the mandatory rules (`must_keep`): placeholders; the step's
   outputs (the loss lives to the end anyway, and the backward's seed reads it); random ops;
   ops that write in place or have side effects; and any node that reads a root buffer
   (directly or through views) which an in-place op writes later in the graph: recomputed in
   backward, it would read the advanced value. Then the policy (`remat.core.policies`) keeps what
   it saves: by default one `l_out` mark per layer; never a dequantized weight (`always_recomputed`).
3. every saved, non-kept node is replaced, for its backward users, by a clone computed from
   kept nodes, placed just before its first backward consumer; clones placed before one
   consumer go in their original forward order. Clones are memoised per region (`regions`: a
   node's layer, the first layer mark after it; a mark belongs to the layer that reads it): a
   backward node reads the clones of the latest region it reads, a clone those of its own
   region; a weight's cast alone is made again for each backward node needing it (`_same_cast`).
   A non-kept layer mark (every:K) is cloned once, for its own region: a second-level checkpoint.
   So a layer's internals are recomputed transiently to make the mark above them, and again,
   from the mark below, for their own backward (Chen et al.'s sqrt(n) scheme).
4. outputs untouched: the same values, bitwise.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from remat.core import alias
from remat.core.capture import copied_value
from remat.core.graph import TrainGraph, copy_node, interpret
from remat.core.marks import mark_name
from remat.core.plan import Plan, Storages, plan, sized_storages
from remat.core.policies import Policy, always_recomputed, layer_index, layer_marks
from remat.core.precision import CAST, backward_reads

CLONE_OF = "remat_clone_of"  # node.meta key: the original a clone recomputes
CLONE_FOR = "remat_clone_for"  # node.meta key: the layer whose backward reads a clone (None: the head's)
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
        if n not in reasons and policy.saves(n) and not always_recomputed(n):
            reasons[n] = policy.name
    return reasons


def saved_nodes(tg: TrainGraph) -> list[fx.Node]:
    fwd = tg.forward_set()
    return [n for n in tg.forward_nodes() if any(u not in fwd for u in n.users)]


Key = tuple[fx.Node, int]  # a clone: the forward node it recomputes and the region it is made for


def regions(forward: list[fx.Node]) -> dict[fx.Node, int]:
    """Each forward node's region: the position of the first layer mark after it (a layer's mark belongs to
    the next layer, which reads it); past the last mark, `len(forward)` (the head and the loss)."""
    region: dict[fx.Node, int] = {}
    upcoming = len(forward)
    for i in reversed(range(len(forward))):
        region[forward[i]] = upcoming
        if layer_index(forward[i]) is not None:
            upcoming = i
    return region


def rewrite(tg: TrainGraph, policy: Policy = LAYER) -> TrainGraph:
    """A new TrainGraph whose backward reads only kept forward nodes and recompute clones (rule 3)."""
    return Rewriter(tg)(policy)


class Rewriter:
    """Rewrites one traced step, under any policy. A budget search rewrites one step many times, so what the
    rewrites share is worked out once: the forward order, the regions, and the fake value of each clone
    (or backward view of one) made again from the very same input values."""

    def __init__(self, tg: TrainGraph):
        self.tg = tg
        self.forward = tg.forward_nodes()
        self.fwd_index = {n: i for i, n in enumerate(self.forward)}
        self.region = regions(self.forward)
        self.values: dict[tuple, tuple[list, object]] = {}  # (what, input value ids) -> (inputs, value)
        self.storages = functools.cache(sized_storages)  # each original's, for plans made without a graph
        self.templates: dict = {}  # `plan.Storages._template`s, shared by those plans
        # A weight's cast (and its views) is made again for each backward node that reads it (and serves that
        # node's backward reading its own cast: `_same_cast`): kept for the region, a tied head's cast would live
        # across every loss piece's backward beside each piece's own (qwen3.5-0.8b in bfloat16 at ctx 512: 485 MiB,
        # half the graph's peak).
        self.casts = {n for n in self.forward if _weight_cast(n)}
        self.pos = {n: i for i, n in enumerate(tg.graph.nodes)}

    def __call__(self, policy: Policy = LAYER, kept: dict[fx.Node, str] | None = None) -> TrainGraph:
        """The step rewritten under `policy`; `kept`, when given, is its `keep_reasons`."""
        made = _Graph()
        env, clones = self._copy(keep_reasons(self.tg, policy) if kept is None else kept, made)
        new = made.graph
        new.lint()
        gm = _LazyGraphModule(self.tg.gm, new)  # its code is made on its first call: a plan never pays for it
        origin: dict[fx.Node, object] = {c: (*key, again) for key, again, c in clones}
        origin.update((c, n) for n, c in env.items() if c not in origin)
        self._fake_values(_fresh(new, {c for *_, c in clones}), origin)
        return TrainGraph(gm=gm, roles=self.tg.roles, names=self.tg.names, boundary=env[self.tg.boundary],
                          info={**self.tg.info, "recompute": policy.name}, workspaces=self.tg.workspaces)

    def plan(self, policy: Policy, kept: dict[fx.Node, str] | None = None, updates: bool = False) -> Plan:
        """`plan(self(policy, kept), updates=updates)`, to the byte, without making the graph: a budget search's
        probe. `updates`: the optimizer in the backward (`plan.in_backward`)."""
        made = Storages(self.storages, self.tg.workspace, self.templates)
        self._copy(keep_reasons(self.tg, policy) if kept is None else kept, made)
        return plan(self.tg, made.order(updates), updates)

    def _copy(self, kept: dict[fx.Node, str],
              made: _Graph | Storages) -> tuple[dict[fx.Node, Any], list[tuple[Key, int, Any]]]:
        """The rewritten step, made by `made` in order; each original's copy, and each clone (its key, and
        how many of that key were made before it: a weight's cast is made again for each backward reader)."""
        fwd_index, region, casts = self.fwd_index, self.region, self.casts
        env: dict[fx.Node, Any] = {}  # original -> its copy (a node, or a position in `Storages`)
        clones: dict[Key, Any] = {}  # the clone a backward node of that region reads
        every: list[tuple[Key, int, Any]] = []
        again: Counter = Counter()
        last_cast: dict[fx.Node, tuple[fx.Node, Any, fx.Node]] = {}  # weight -> its cast, the clone, made for

        for n in self.forward:
            env[n] = made.copy(n, env.__getitem__)

        def made_for(n: fx.Node, r: int) -> Key:
            # a layer mark's clone is made once, for its own region; any other node's for the region wanting it
            return (n, region[n]) if layer_index(n) is not None else (n, r)

        def value(a: fx.Node, r: int):  # what a clone made for region r reads for forward node a
            return env[a] if a in kept else clones[made_for(a, r)]

        def read(a: fx.Node, r: int):  # what a backward node of region r reads for a
            return value(a, r) if a in fwd_index else env[a]

        def needed(n: fx.Node, r: int, acc: set[Key]) -> None:
            # the clones not made yet that region r needs to read n, n's own included
            stack = [made_for(n, r)]
            while stack:
                key = stack.pop()
                if key[0] in kept or key in clones or key in acc:
                    continue
                acc.add(key)
                stack.extend(made_for(a, key[1]) for a in key[0].all_input_nodes)

        for n in list(self.tg.graph.nodes)[len(self.forward):]:
            reads = [a for a in n.all_input_nodes if a in fwd_index]
            r = max((region[a] for a in reads), default=len(self.forward))  # the latest layer the node reads
            todo: set[Key] = set()
            for a in reads:
                needed(a, r, todo)
            for m, mr in sorted(todo, key=lambda k: (fwd_index[k[0]], k[1])):
                clones[m, mr] = made.clone(m, functools.partial(value, r=mr), self._layer(mr))
                every.append(((m, mr), again[m, mr], clones[m, mr]))
                again[m, mr] += 1
            same = self._same_cast(n, last_cast)
            env[n] = made.copy(n, functools.partial(read, r=r)) if same is None else same
            for key in [k for k in todo if k[0] in casts]:
                weight = key[0].args[0]
                if key[0].target is CAST and isinstance(weight, fx.Node):
                    last_cast[weight] = (key[0], clones[key], n)
                del clones[key]
        return env, every

    def _same_cast(self, n: fx.Node, last_cast: dict[fx.Node, tuple[fx.Node, Any, fx.Node]]) -> Any:
        """The clone of the weight's cast that the backward's own cast `n` (`precision.casts_where_read`) can be,
        or None: the same op, made for a backward node whose value flows into each of `n`'s readers. So a loss
        piece casts the head's weight once, for its logits' recompute and the product its backward reads it in
        (a cast of qwen3.5-0.8b's head is 0.23 s), and the cast does not live on into the next piece."""
        weight = n.args[0] if n.target is CAST else None
        if not isinstance(weight, fx.Node) or weight not in last_cast:
            return None
        cast, clone, made_for = last_cast[weight]
        if (n.args, n.kwargs) != (cast.args, cast.kwargs):
            return None
        readers = [r for _, r in backward_reads(n, self.pos, self.pos[self.tg.boundary])]
        return clone if readers and all(self._reaches(made_for, r) for r in readers) else None

    def _reaches(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether `b` reads what `a` makes, through the graph."""
        pos, stack, seen = self.pos, [a], {a}
        while stack:
            for u in stack.pop().users:
                if u is b:
                    return True
                if u not in seen and pos[u] < pos[b]:
                    seen.add(u)
                    stack.append(u)
        return False

    def _layer(self, r: int) -> int | None:
        """The layer whose backward reads region r's clones: the one its mark ends (None: the head)."""
        return layer_index(self.forward[r]) if r < len(self.forward) else None

    def _fake_values(self, fresh: list[fx.Node], origin: dict[fx.Node, object]) -> None:
        """`capture.copied_value` for `fresh`, reusing the value an earlier rewrite made from the same inputs:
        within one graph, `origin` (a clone's key, a backward node's original) names one node."""
        for n in fresh:
            inputs = [a.meta["val"] for a in n.all_input_nodes]
            key = (origin[n], *map(id, inputs))  # the entry holds its inputs: their ids stay theirs
            if key not in self.values:
                made = origin[n]  # a clone's key (the original, its region), or a backward node's original
                original = made[0] if isinstance(made, tuple) else made
                assert isinstance(original, fx.Node)
                self.values[key] = (inputs, copied_value(original, n))
            n.meta["val"] = self.values[key][1]


class _Graph:
    """Makes the rewritten step as an fx graph."""

    def __init__(self) -> None:
        self.graph = fx.Graph()

    def copy(self, n: fx.Node, arg: Callable[[fx.Node], fx.Node]) -> fx.Node:
        return copy_node(self.graph, n, arg)

    def clone(self, n: fx.Node, arg: Callable[[fx.Node], fx.Node], layer: int | None) -> fx.Node:
        c = copy_node(self.graph, n, arg)
        c.meta[CLONE_OF] = n.name
        c.meta[CLONE_FOR] = layer
        return c


def _weight_cast(n: fx.Node) -> bool:
    """A cast of a placeholder (a weight read in the compute dtype), or a view made of one alone."""
    while n.target is not CAST:
        source = alias.view_source(n)
        if source is None or n.all_input_nodes != [source]:
            return False
        n = source
    return isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"


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
    output: int | None = None  # which of a tuple result's outputs (topk's values 0, indices 1); None: the value


# What `verify` compares, as the CLI says it.
COMPARED = ("each clone where the backward reads it (a tuple result's outputs its readers take), with its original "
            "as made")


@dataclass
class VerifyResult:
    clones: int
    first_difference: Difference | None

    @property
    def equal(self) -> bool:
        return self.first_difference is None


def read_outputs(node: fx.Node) -> list[int] | None:
    """The outputs of a tuple result that the node's readers take (`getitem`), in order; None for one value.

    A router's `topk` is recomputed for its indices alone when the forward divides its values in place
    (Mixtral's `routing_weights /= sum`): its values are not what the backward reads."""
    if not node.users or any(u.target is not operator.getitem for u in node.users):
        return None
    return sorted({int(u.args[1]) for u in node.users})  # type: ignore[arg-type]  # a getitem's index: an int


def _written_later(graph: fx.Graph, nodes: set[fx.Node]) -> set[fx.Node]:
    """Those of `nodes` whose memory (theirs, or a tuple output's) an in-place op writes after them."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    root = alias.roots(graph)
    writes = alias.writes_by_root(graph, root)
    out = set()
    for n in nodes:
        parts = [n, *(u for u in n.users if u.target is operator.getitem)]
        if any(w > pos[n] for p in parts for w in writes.get(root[p], ())):
            out.add(n)
    return out


def verify(tg: TrainGraph, args: list[torch.Tensor]) -> VerifyResult:
    """Run a rewritten graph, comparing each clone with its original (kept alive for it), bitwise.

    What is compared is what the backward reads: of a tuple result, the outputs the clone's readers take;
    and the original as it was made (a copy is kept of one that a later in-place op writes)."""
    nodes = {n.name: n for n in tg.graph.nodes}
    pairs = {n: nodes[n.meta[CLONE_OF]] for n in tg.graph.nodes if CLONE_OF in n.meta}
    next_mark, upcoming = {}, None
    for n in reversed(tg.forward_nodes()):
        upcoming = mark_name(n) or upcoming
        next_mark[n] = upcoming
    changed = _written_later(tg.graph, set(pairs.values()))
    as_made: dict[fx.Node, object] = {}
    first: list[Difference] = []

    def check(node: fx.Node, value: object, env: dict) -> None:
        if node in changed:
            as_made[node] = [t.clone() if isinstance(t, torch.Tensor) else t for t in _outputs(value)]
        if node not in pairs or first:
            return
        original = pairs[node]
        made = _outputs(as_made.get(original, env[original]))
        for i in read_outputs(node) or range(len(made)):
            a, b = _outputs(value)[i], made[i]
            if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")
                first.append(Difference(node.name, _op(node), next_mark[original], list(a.shape), diff,
                                        i if isinstance(value, (tuple, list)) else None))
                return

    interpret(tg.gm, args, on_node=check, keep=set(pairs.values()))
    return VerifyResult(len(pairs), first[0] if first else None)


def _outputs(value: object) -> list:
    """A node's value as a list of outputs: a tuple result's, or the one value."""
    return list(value) if isinstance(value, (tuple, list)) else [value]
