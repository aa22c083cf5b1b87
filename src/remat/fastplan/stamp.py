"""The step of an N-layer model, stamped from the trace of a few of its layers (plans only).

Decoder layers of one type are one function on different weights, so tracing all N of them repeats the
same work N times (most of `remat plan`'s time). The layers are told apart by type (`signature`: module
classes, weight shapes, the plain settings their modules keep), and the model is traced with its first layer
(it reads the embedding) and two layers of every type after it, the type's first and its second, or the last
layer (it feeds the head) where that is of the type (`Picked`; the config's per-layer lists, such as
`layer_types`, cut to match): qwen3.5-0.8b's 24 layers, 18 linear-attention and 6 full, the last full, trace as
layers 0, 1, 2, 3 and 23; SmolLM2's 30 as 0, 1 and 29. The two of a type are checked to be the same graph,
forward and backward: op for op, each argument playing the same part (a node of its own layer; a value the
layer below or above, or the head, passes on, by its rank among what it passes on: the mark below, the
gradient from above; its own parameter; a shared node such as the rotary tables). Every layer after the first
is then the second of its type, copied on its own parameters, reading the same-ranked values of the layers
that are below and above it in the whole model. A last layer whose check fails (it differs from its type's
others beyond its signature) stands for itself, and the model is traced again without copying it.
The result is the graph the whole trace makes, node for node (`tests/test_stamp.py` holds that on every
family of the conformance matrix); a model whose layers do not repeat, or whose trace does not split
into layers this way, is traced whole (`stamp` raises NotStampable).

A plan does not even make the whole graph (`Stamper.plan`): it walks the same copies as the planner sees
them (each node's storages and last reader, `plan.Storages`), and a policy that saves alike in every layer
(on, dots) rewrites the small trace first, its recompute clones belonging to the layer whose backward reads
them, and stamps that. `tests/test_stamp.py` holds these plans to the whole trace's, byte for byte.

Only plans use it: a stamped graph is never run (its model has fake weights), so a layer that differs
beyond what the checks see could misplan memory but never change training.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._lazy_graph_module import _LazyGraphModule

from remat.core.capture import copied_value
from remat.core.graph import StepInputs, TrainGraph, copy_node
from remat.core.marks import LAYER_MARK, MARK_OP
from remat.core.plan import Plan, Storages, planned, sized_storages, storages_of
from remat.core.policies import Policy, layer_index
from remat.core.recompute import CLONE_FOR, Rewriter
from remat.fastplan.picking import NotStampable, Picked, pick, qualified_name, signature
from remat.models.hf import UnsupportedModel, decoder_layers, only_layers, prepare

SmallTrace = Callable[[tuple[int, ...]], TrainGraph]  # the step traced while the model runs only these layers
Inputs = Mapping[str, tuple[str, object]]  # a step's own inputs after the model's tensors: name -> (role, value)


def stamp(model: nn.Module, trace_small: SmallTrace, picked: Picked | None = None,
          inputs: Inputs | None = None, graph: bool = False) -> Stamper:
    """The whole model's step from `trace_small(traced)` (the same trace, made while the model runs only the layers
    `Picked.traced`): its graph and plans (`Stamper`); NotStampable, with why, when the model must be traced
    whole. `picked`: the layers an earlier stamp of this model picked (`Stamper.picked`; a model's layers are
    fixed once built), else picked here. `inputs`: the whole step's own inputs, where the small trace has fewer
    (the walk's: every layer's states), else the small trace's. `graph`: the whole graph is wanted (made here,
    the last check that the model stamps, and kept), else a plan's walk of it (`Stamper.walked`) makes that check."""
    prepare(model)  # the layer marks are numbered by the whole list, before it is cut
    layers = decoder_layers(model)
    if picked is None:
        picked = pick([signature(m) for m in layers])
    try:
        return _stamped(model, layers, picked, trace_small, inputs, graph)
    except NotStampable:
        if not picked.last_copied:
            raise
    # the last layer is not like its type's others beyond what its signature shows (axk1's backward holds more):
    # it stands for itself, from now on (the stamper's `picked`)
    return _stamped(model, layers, pick([signature(m) for m in layers], last_copied=False), trace_small, inputs, graph)


def stand_ins(model: nn.Module) -> list[int] | None:
    """Each layer's stand-in among the layers a stamp traces (the one it is copied from, or itself), for the walk's
    probes of a planning model (`hf_cache.Probes`); None where the model does not stamp."""
    try:
        prepare(model)  # as `stamp` picks
        picked = pick([signature(m) for m in decoder_layers(model)])
    except (NotStampable, UnsupportedModel):
        return None
    return [picked.traced[picked.source_of(i)] for i in range(picked.n)]


def _stamped(model: nn.Module, layers: nn.ModuleList, picked: Picked, trace_small: SmallTrace,
             inputs: Inputs | None, graph: bool) -> Stamper:
    with only_layers(model, layers, picked.traced):
        try:
            small = trace_small(picked.traced)
        except (KeyError, IndexError) as e:  # a model that keeps tables by layer (Zamba2's) runs no cut list
            raise NotStampable(f"layers {list(picked.traced)} do not run alone: {type(e).__name__} {e}") from e
    stamper = Stamper(small, Numbering(qualified_name(model, layers)), picked, StepInputs.of(model), inputs)
    stamper.graph() if graph else stamper.walked  # the last checks: NotStampable here, not later
    return stamper


# ---------------------------------------------------------------------------------------------- segments


@dataclass
class Segments:
    """The small trace split by place (`Picked`): forward[j] runs from after the mark that ends place j-1 through
    the one that ends place j (forward[0] from the first node: what comes before the layers, rotary tables and
    masks, is shared); forward[head] is the head. A backward node belongs to the earliest place it reads (the
    mark that ends one counts as the next one's input): backward[j] runs from the first node of place j to the
    first of place j-1, backward[head] is what runs before the last layer's, backward[0] all after place 1's.
    `passed[kind, j]`: the nodes of a segment that the place below or above reads, in order (of the first one's
    forward, only its mark): a layer reads its neighbours' by their rank there."""

    forward: list[list[fx.Node]]
    backward: list[list[fx.Node]]
    place: dict[fx.Node, tuple[str, int]]  # node -> ("F" or "B", place)
    passed: dict[tuple[str, int], list[fx.Node]]


def _segments(tg: TrainGraph, numbering: Numbering, picked: Picked) -> Segments:
    fwd = [n for n in tg.forward_nodes() if n.op != "placeholder"]
    marks = [i for i, n in enumerate(fwd) if layer_index(n) is not None]
    if [layer_index(fwd[i]) for i in marks] != list(picked.traced):
        raise NotStampable(f"the layer marks are not {list(picked.traced)} in order")
    k, cuts = picked.head, [0, *(i + 1 for i in marks)]
    forward = [fwd[cuts[j]:cuts[j + 1]] for j in range(k)] + [fwd[cuts[k]:]]
    place = {n: ("F", j) for j, seg in enumerate(forward[:k]) for n in seg}
    # the mark that ends a place is the next one's input: the backward nodes that read it belong to the next
    label: dict[fx.Node, int] = {n: j + (n is forward[j][-1]) for n, (_, j) in place.items()}
    for p, name in zip(tg.placeholders(), tg.names):
        layer = numbering.layer(name)
        if layer is not None:
            label[p] = picked.traced.index(layer)
    place.update((n, ("F", k)) for n in forward[k])
    for n in tg.graph.nodes:  # a recompute clone belongs to the layer whose backward reads it
        if CLONE_FOR in n.meta:
            layer = n.meta[CLONE_FOR]
            label[n] = k if layer is None else picked.traced.index(layer)
    nodes, starts = backward_starts(tg, label, k, "the backward does not run layer by layer")
    backward = [nodes[starts[k - 1 - j]:(starts[k - j] if j else len(nodes))] for j in range(k)] + [nodes[:starts[0]]]
    place.update((n, ("B", j)) for j, seg in enumerate(backward) for n in seg)
    read_next_door = {a for x in tg.graph.nodes if x in place
                      for a in x.all_input_nodes if a in place and abs(place[a][1] - place[x][1]) == 1}
    passed = {(kind, j): [n for n in seg if n in read_next_door]
              for kind, segs in (("F", forward), ("B", backward)) for j, seg in enumerate(segs)}
    passed["F", 0] = forward[0][-1:]  # the rest of the first layer's forward is shared (see `Stamper._role`)
    return Segments(forward, backward, place, passed)


def backward_starts(tg: TrainGraph, label: dict[fx.Node, int], count: int, refusal: str) -> tuple[list, list[int]]:
    """The backward's nodes, and where segments count-1 .. 0 start among them (the backward runs the last
    first). A backward node belongs to the earliest segment it reads (`label`, given for the forward's
    nodes, gets the backward's too); NotStampable(`refusal`) unless the segments start in that order."""
    fset = tg.forward_set()
    nodes = [n for n in tg.graph.nodes if n not in fset and n.op != "output"]
    first: dict[int, int] = {}
    for at, n in enumerate(nodes):
        reads = [label[a] for a in n.all_input_nodes if a in label]
        if n not in label and reads:
            label[n] = min(reads)
        if n in label:
            first.setdefault(label[n], at)
    starts = [first.get(i, -1) for i in range(count - 1, -1, -1)]
    if sorted(starts) != starts or starts[0] < 0:
        raise NotStampable(refusal)
    return nodes, starts


class Numbering:
    """Layer numbers in tensor names: `{decoder list}.{i}.` (`model.layers.3.mlp.up_proj.weight`, and the walk's
    gradient sum of it, `grad.model.layers.3....`), and the walk's states (`k.3`, `grad.v.3`, `conv.3.1`,
    `grad_start.recurrent.3`: `models.hf_cache.state_layer`)."""

    STATE = re.compile(r"^(?:grad(?:_start)?\.)?(?:k|v|conv|recurrent)\.(\d+)(?:\.\d+)?$")

    def __init__(self, layers_name: str):
        self.pattern = re.compile(rf"(?:^|\.){re.escape(layers_name)}\.(\d+)\.")

    def _match(self, name: str) -> re.Match | None:
        return self.pattern.search(name) or self.STATE.match(name)

    def layer(self, name: str) -> int | None:
        m = self._match(name)
        return int(m[1]) if m else None

    def renumber(self, name: str, to: int) -> str:
        m = self._match(name)
        assert m is not None, name
        return name[:m.start(1)] + str(to) + name[m.end(1):]


# ---------------------------------------------------------------------------------------------- stamping


class Stamper:
    """The small trace split by place, each type's two layers checked alike, and the whole step made from it,
    every layer of the model from its source place: its graph (`graph`), or only its plan (`plan`)."""

    def __init__(self, small: TrainGraph, numbering: Numbering, picked: Picked, full: StepInputs,
                 inputs: Inputs | None = None):
        self.small, self.picked, self.n, self.full = small, picked, picked.n, full
        self.inputs = inputs  # the whole step's own inputs (None: the small trace's)
        self.name_of = dict(zip(small.placeholders(), small.names))
        self.numbering = numbering
        self.seg = _segments(small, self.numbering, picked)
        self.index = {node: i for seg in [*self.seg.forward, *self.seg.backward] for i, node in enumerate(seg)}
        self.rank = {node: i for seg in self.seg.passed.values() for i, node in enumerate(seg)}
        self.shared_mark = self.seg.forward[0][-1]
        for a, b in picked.alike:
            for kind in ("F", "B"):
                self._check_alike(kind, a, b)

    def _segment(self, kind: str, place: int) -> list[fx.Node]:
        return (self.seg.forward if kind == "F" else self.seg.backward)[place]

    # Each argument of a layer's node, by the part it plays; two layers are alike when every node's are equal.
    def _role(self, arg: object, place: int) -> object:
        own = self.picked.traced[place]
        if not isinstance(arg, fx.Node):
            return ("mark",) if arg == f"{LAYER_MARK}.{own}" else arg
        if arg.op == "placeholder":
            name = self.name_of[arg]
            layer = self.numbering.layer(name)
            if layer is None:
                return ("param", name)
            if layer != own:
                raise NotStampable(f"layer {own} reads {name}, another layer's parameter")
            return ("own param", self.numbering.renumber(name, 0))
        kind, at = self.seg.place[arg]
        if (kind, at) == ("F", 0) and arg is not self.shared_mark:
            return ("shared", arg)  # the first place holds what comes before the layers too (rotary tables, masks)
        if at == place:
            return ("own", kind, self.index[arg])
        if abs(at - place) == 1:
            return ("below" if at < place else "above", kind, self.rank[arg])
        raise NotStampable(f"layer {own} reads {arg.name}, of a layer not next to it")

    def _roles(self, node: fx.Node, place: int) -> tuple:
        return node.op, node.target, mapped((node.args, node.kwargs), lambda a: self._role(a, place))

    def _check_alike(self, kind: str, a: int, b: int) -> None:
        sa, sb = self._segment(kind, a), self._segment(kind, b)
        la, lb = self.picked.traced[a], self.picked.traced[b]
        if len(sa) != len(sb):
            raise NotStampable(f"layers {la} and {lb} differ in length ({kind})")
        for x, y in zip(sa, sb):
            if self._roles(x, a) != self._roles(y, b):
                raise NotStampable(f"layers {la} and {lb} differ at {x.name} / {y.name}")

    # ------------------------------------------------------------------ the whole graph
    def graph(self) -> TrainGraph:
        return self.whole

    @functools.cached_property
    def whole(self) -> TrainGraph:
        small, p = self.small, self.picked
        new = fx.Graph()
        env: dict[tuple[fx.Node, int], fx.Node] = {}  # (small node, the model's layer it stands for) -> new node
        places = self._placeholders(new)
        order = self._order()
        for node, layer in order:
            copied = env[node, layer] = copy_node(new, node, functools.partial(self._read, layer=layer, reader=node,
                                                                                env=env, places=places))
            if node.target is MARK_OP and layer_index(node) is not None:
                copied.args = (copied.args[0], f"{LAYER_MARK}.{layer}")
        new.output(self._outputs(self._output(), env, places))
        self._values(new, order, env)
        gm = _LazyGraphModule(small.gm, new)  # its code is made on its first call: a plan never pays for it
        boundary = env[small.boundary, p.layer(self.seg.place[small.boundary][1])]
        return TrainGraph(gm=gm, roles=self._roles_full(), names=self._names_full(), boundary=boundary,
                          info=small.info, workspaces=small.workspaces)

    def plan(self, policy: Policy | None = None, updates: bool = False) -> Plan:
        """`plan(rewrite(self.graph(), policy), updates=updates)` (None: `plan(self.graph())`), to the byte, without
        making the whole graph: the small trace rewritten, then stamped as the planner sees it (`plan.Storages`).
        NotStampable where the rewritten trace does not stamp. Only for a policy that treats every layer alike
        (every:K keeps a layer's mark by its number, so the layer copied does not stand for every other)."""
        if policy is not None:
            rewritten = Rewriter(self.small)(policy)
            return Stamper(rewritten, self.numbering, self.picked, self.full, self.inputs).plan(None, updates)
        inputs = list(zip(self._roles_full(), self._input_values().values()))
        made = self.walked
        return planned(inputs, made.made_grads(), made.order(updates), self.small.info, updates)

    @functools.cached_property
    def walked(self) -> Storages:
        """The whole step as the planner sees it: each node's storages and last reader, in order. Walking it reads
        every value as `graph` does: the last check that the model stamps (`_read`, `_outputs`)."""
        made = Storages(functools.cache(sized_storages), self.small.workspace)
        values = self._input_values()
        places = {name: made.input(("input", name), _nbytes(values[name])) for name in self._names_full()}
        env: dict[tuple[fx.Node, int], int] = {}  # (small node, the model's layer it stands for) -> its position
        copied = [not self.picked.itself(place) for place in range(self.picked.head + 1)]
        for node, layer in self._order():
            read = functools.partial(self._read, layer=layer, reader=node, env=env, places=places)
            env[node, layer] = made.copy(node, read, new=copied[self.seg.place[node][1]])
        made.output(list(self._outputs(self._output(), env, places)))
        return made

    def _order(self) -> list[tuple[fx.Node, int]]:
        """Every node of the whole graph (placeholders aside) as (the small node it copies, its layer), in the
        whole trace's order: the layers' forwards, the head's forward and backward, the layers' backwards."""
        s, p, n = self.seg, self.picked, self.n
        return [*((x, i) for i in range(n + 1) for x in s.forward[p.source_of(i)]),
                *((x, i) for i in range(n, -1, -1) for x in s.backward[p.source_of(i)])]

    def _read(self, arg: fx.Node, *, layer: int, reader: fx.Node, env: dict, places: dict[str, Any]) -> Any:
        """The new node that `reader`, standing for `layer`, reads for the small-trace node `arg`."""
        p = self.picked
        at_reader = self.seg.place[reader][1]
        if arg.op == "placeholder":
            name = self.name_of[arg]
            own = self.numbering.layer(name)
            if own is not None and at_reader != p.head and own == p.traced[at_reader]:
                name = self.numbering.renumber(name, layer)
            elif own is not None and not p.itself(p.traced.index(own)):
                raise NotStampable(f"{reader.name} reads {name}, a copied layer's parameter")
            return places[name]
        kind, at = self.seg.place[arg]
        if at == at_reader:
            return env[arg, layer]
        if (kind, at) == ("F", 0) and arg is not self.shared_mark:
            return env[arg, 0]
        if abs(at - at_reader) == 1:
            to = layer + (1 if at > at_reader else -1)  # the layer next to this one in the whole model
            source = p.source_of(to)
            if source != at:
                passed, was = self.seg.passed[kind, source], self.seg.passed[kind, at]
                if len(passed) != len(was):
                    raise NotStampable(f"layers {p.traced[source]} and {p.traced[at]} pass on different values")
                arg = passed[self.rank[arg]]
            return env[arg, to]
        if p.itself(at) and p.itself(at_reader):
            return env[arg, p.layer(at)]
        raise NotStampable(f"{reader.name} reads {arg.name}, of a layer not next to it")

    # ------------------------------------------------------------------ placeholders and outputs
    def _names_full(self) -> list[str]:
        return list(self._input_values())

    def _roles_full(self) -> list[str]:
        f, own = self.full, self._own_inputs()
        sums = ["grad"] * len(f.trainable) if "grad" in self.small.roles else []
        return (["trainable"] * len(f.trainable) + ["frozen"] * len(f.frozen) + ["buffer"] * len(f.buffers)
                + [role for role, _ in own.values()] + sums)

    def _own_inputs(self) -> Inputs:
        """The whole step's inputs after the model's tensors, its gradient sums aside (the walk's: role "grad")."""
        if self.inputs is not None:
            return self.inputs
        return {name: (role, p.meta["val"]) for p, name, role in zip(self.small.placeholders(), self.small.names,
                                                                     self.small.roles)
                if role in ("input", "state")}

    @functools.cached_property
    def _inputs_by_name(self) -> dict[str, object]:
        tensors: dict[str, object] = {**self.full.trainable, **self.full.frozen, **self.full.buffers}
        values = tensors | {name: value for name, (_, value) in self._own_inputs().items()}
        if "grad" in self.small.roles:  # the walk's sums, one per trainable tensor of the whole model: their
            # layouts (meta tensors: a plan reads no more, and a fake tensor made from each cost a second a hundred)
            values |= {f"grad.{k}": torch.empty_like(t, device="meta") for k, t in self.full.trainable.items()}
        return values

    def _input_values(self) -> dict[str, object]:
        """The whole step's inputs by name: the model's tensors, its own inputs, then its gradient sums (a walk's)."""
        return self._inputs_by_name

    def _placeholders(self, new: fx.Graph) -> dict[str, fx.Node]:
        values = self._input_values()
        mode = next(v.fake_mode for v in values.values() if isinstance(v, FakeTensor))
        places = {}
        for i, (name, t) in enumerate(values.items()):
            p = new.placeholder(f"arg{i}_1")  # make_fx's names
            p.meta["val"] = t if isinstance(t, FakeTensor) or not isinstance(t, torch.Tensor) else mode.from_tensor(t)
            places[name] = p
        return places

    def _output(self) -> fx.Node:
        return next(x for x in reversed(self.small.graph.nodes) if x.op == "output")

    def _outputs(self, out: fx.Node, env: dict, places: dict[str, Any]) -> tuple:
        results = [r for r in out.args[0] if isinstance(r, fx.Node)]  # type: ignore[union-attr]
        if len(results) != len(out.args[0]):  # type: ignore[arg-type]
            raise NotStampable("a grad that is not a graph value")
        p = self.picked
        loss, *grads = results
        by_name = dict(zip(self.small.names, grads))  # trainables come first, in the order of the grads
        new = [env[loss, p.layer(self.seg.place[loss][1])]]
        for name in self.full.trainable:
            layer = self.numbering.layer(name)
            source = p.head if layer is None else p.source[layer]
            g = by_name[name if layer is None else self.numbering.renumber(name, p.traced[source])]
            if g.op == "placeholder":  # a walk's gradient sum: the step returns it, added into
                new.append(places[f"grad.{name}"])
                continue
            at = self.seg.place[g][1]
            if at == source:
                new.append(env[g, p.n if layer is None else layer])
            elif p.itself(at) and p.itself(source):
                new.append(env[g, p.layer(at)])
            else:
                raise NotStampable(f"the grad of {name} is not made by its own layer")
        return tuple(new)

    def _values(self, new: fx.Graph, order: list[tuple[fx.Node, int]], env: dict) -> None:
        """Fake values: each copy's results in storages of their own, laid out as the original's (as a trace
        would have made them), or in its inputs' where the original's share its inputs' (views, in-place
        results); a node standing for itself that shares the storage of a copy or a placeholder it reads,
        likewise."""
        p = self.picked
        redone = {n for n in new.nodes if n.op == "placeholder"}  # renumbered: a traced view may read another
        for node, layer in order:
            c = env[node, layer]
            if (not p.itself(self.seg.place[node][1])
                    or (any(a in redone for a in c.all_input_nodes) and shares_an_input(node))):
                c.meta["val"] = copied_value(node, c)
                redone.add(c)


def _nbytes(value: object) -> int:
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def shares_an_input(node: fx.Node) -> bool:
    inputs = {r for a in node.all_input_nodes for r in storages_of(a)}
    return any(r in inputs for r in storages_of(node))


def mapped(args: object, fn) -> object:
    """`args` with every leaf mapped by `fn` (nested tuples, lists and dicts as fx keeps them)."""
    if isinstance(args, (tuple, list)):
        return tuple(mapped(a, fn) for a in args)
    if isinstance(args, dict):
        return tuple((k, mapped(v, fn)) for k, v in args.items())
    return fn(args)
