"""The step of an N-layer model, stamped from the trace of its first few layers (plans only).

Decoder layers of one type are one function on different weights, so tracing all N of them repeats the
same work N times (most of `remat plan`'s time). The layers split into a prefix, units of p alike layers
(p = 1 for most models; a repeating group for hybrids: qwen3.5's 3 linear-attention layers and 1 full)
and a suffix (`Units`). The model is traced with its prefix, two units and its suffix; units 1 and 2 of
that trace are checked to be the same graph (op for op, each argument playing the same part: its own
unit's node, the unit below's, its own parameter, a shared node), forward and backward. Unit 2's forward
and backward are then copied for every unit after the first, on their own parameters, between the traced
prefix and first unit and the traced suffix (renumbered): the suffix reads the top copy as it read unit 2,
and each copy reads the copy below (and, backward, the one above) as unit 2 read unit 1 (and unit 1 read
unit 2), which the check makes the same reads.
The result is the graph the whole trace makes, node for node (`tests/test_stamp.py` holds that on every
family of the conformance matrix); a model whose layers do not repeat, or whose trace does not split
into layers this way, is traced whole (`stamp` raises NotStampable).

Only plans use it: a stamped graph is never run (its model has fake weights), so a layer that differs
beyond what the checks see could misplan memory but never change training.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._lazy_graph_module import _LazyGraphModule

from remat.capture import copied_value
from remat.graph import StepInputs, TrainGraph, copy_node
from remat.hf import decoder_layers, prepare
from remat.marks import LAYER_MARK, MARK_OP
from remat.plan import _storages
from remat.policies import layer_index

SEGMENTS = 4  # the small trace's: the prefix, the unit below the copies, the copied unit, the suffix
COPIES = 2  # the fewest units a stamp copies (with fewer, the small trace is most of the whole)


class NotStampable(Exception):
    """The trace does not split into alike layers: trace the model whole."""


def stamp(model: nn.Module, trace_small: Callable[[], TrainGraph]) -> TrainGraph:
    """The whole model's step from `trace_small()` (the same trace, made while the model has its first
    `Units.traced` decoder layers); NotStampable, with why, when the model must be traced whole."""
    prepare(model)  # the layer marks are numbered by the whole list, before it is cut
    layers = decoder_layers(model)
    units = _units([_signature(m) for m in layers])
    prefix = _qualified_name(model, layers)
    with _first_layers(layers, units.traced):
        try:
            small = trace_small()
        except (KeyError, IndexError) as e:  # a model that keeps tables by layer (Zamba2's) runs no cut list
            raise NotStampable(f"its first {units.traced} layers do not run alone: {type(e).__name__} {e}") from e
    return _Stamper(small, prefix, units, StepInputs.of(model)).graph()


# ---------------------------------------------------------------------------------------------- units


@dataclass(frozen=True)
class Units:
    """How the n decoder layers split: a prefix of `a` layers, `count` units of `p` layers (alike unit for unit:
    one layer for most models, a repeating group for hybrids such as qwen3.5's 3 linear : 1 full), a suffix of
    `s` layers. The small trace has the prefix, two units (below the copies, the copied one) and the suffix;
    the first layers of a model repeat with the same period, so the small model's suffix is the whole one's.
    The stamped graph numbers its layers virtually: 0 the prefix, 1..count the units, then the suffix
    (`layers`)."""

    n: int
    a: int
    p: int
    s: int

    @property
    def count(self) -> int:
        return (self.n - self.a - self.s) // self.p

    @property
    def layers(self) -> int:
        return self.count + 2

    @property
    def traced(self) -> int:
        return self.a + 2 * self.p + self.s

    def small(self, j: int) -> tuple[int, int]:
        """A traced layer's segment (0 the prefix, 1-2 the units, 3 the suffix) and its place in it."""
        if j < self.a:
            return 0, j
        if j < self.a + 2 * self.p:
            return 1 + (j - self.a) // self.p, (j - self.a) % self.p
        return SEGMENTS - 1, j - self.a - 2 * self.p

    def traced_layer(self, segment: int, r: int) -> int:
        return r if segment == 0 else self.a + (segment - 1) * self.p + r

    def full(self, virtual: int, r: int) -> int:
        """The model's layer at place r of a virtual layer."""
        if virtual == 0:
            return r
        if virtual == self.layers - 1:
            return self.n - self.s + r
        return self.a + (virtual - 1) * self.p + r

    def virtual(self, i: int) -> tuple[int, int]:
        """The model's layer i's virtual layer and place in it."""
        if i < self.a:
            return 0, i
        if i >= self.n - self.s:
            return self.layers - 1, i - (self.n - self.s)
        return 1 + (i - self.a) // self.p, (i - self.a) % self.p

    def ends(self) -> list[int]:
        """The last traced layer of each segment."""
        return [self.a - 1, *(self.a + k * self.p - 1 for k in (1, 2)), self.traced - 1]


def _units(signatures: list[tuple]) -> Units:
    """The split that traces the fewest layers: for each period p, the shortest prefix (at least one layer: the
    first reads the embedding) after which every layer is the one p below it; NotStampable when none copies
    COPIES units."""
    n, best = len(signatures), None
    for p in range(1, n // (2 + COPIES) + 1):
        a = next((a for a in range(1, n) if all(signatures[j] == signatures[j - p] for j in range(a + p, n))), n)
        s = (n - a - 1) % p + 1  # at least one: the last layer feeds the head
        units = Units(n, a, p, s)
        if units.count >= 2 + COPIES and (best is None or units.traced < best.traced):
            best = units
    if best is not None:
        return best
    if n < 2 + COPIES + 2:
        raise NotStampable(f"{n} layers: too few to copy one")
    i = next(i for i in range(2, n) if signatures[i] != signatures[1])
    raise NotStampable(f"its layers do not repeat: {_difference(signatures[1], signatures[i])} (layers 1, {i})")


# ---------------------------------------------------------------------------------------------- layers


_POSITION = re.compile(r"layer_?(idx|id|index|number)|block_?(idx|id)")


def _signature(layer: nn.Module) -> tuple:
    """What can make two layers different functions: module classes, parameter and buffer shapes, and the
    plain settings the modules keep (sliding window or not, layer type, ...), its own position aside."""
    parts: list = []
    for name, m in layer.named_modules():
        settings = sorted((k, repr(v)) for k, v in vars(m).items()
                          if not k.startswith("_") and not _POSITION.fullmatch(k) and k != "training"
                          and isinstance(v, (int, float, str, bool, type(None), tuple, list)))
        tensors = [(k, tuple(t.shape), t.dtype, t.requires_grad)
                   for k, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]
        parts.append((name, type(m).__qualname__, tuple(settings), tuple(tensors)))
    return tuple(parts)


def _difference(a: tuple, b: tuple) -> str:
    """What differs between two layer signatures, in a few words."""
    for (name, cls, settings, tensors), (name_b, cls_b, settings_b, tensors_b) in zip(a, b):
        where = name or "the layer"
        if (name, cls) != (name_b, cls_b):
            return f"{where}: {cls} / {name_b or 'the layer'}: {cls_b}"
        keys = sorted({k for k, _ in set(settings) ^ set(settings_b)})
        if keys:
            return f"{where} {', '.join(keys)}"
        if tensors != tensors_b:
            return f"{where}'s weights"
    return "their module trees"


def _qualified_name(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, m in model.named_modules() if m is layers)


@contextlib.contextmanager
def _first_layers(layers: nn.ModuleList, k: int) -> Iterator[None]:
    """The decoder runs its first k layers only (the model iterates over its layer list; slices of it by the
    configured depth stop at the list's end)."""
    saved = dict(layers._modules)
    layers._modules = {key: m for i, (key, m) in enumerate(saved.items()) if i < k}
    try:
        yield
    finally:
        layers._modules = saved


# ---------------------------------------------------------------------------------------------- segments


@dataclass
class Segments:
    """The small trace split by segment (`Units.small`): forward F[i] runs from after the mark that ends segment
    i-1 through the one that ends segment i (F[0] from the first node). A backward node belongs to the earliest
    segment it reads (the mark that ends one counts as the next one's input), and backward B[i] runs from the
    first node of segment i to the first of segment i-1, i = 1..3."""

    forward: list[list[fx.Node]]
    backward: dict[int, list[fx.Node]]
    layer_of: dict[fx.Node, tuple[str, int]]  # node -> ("F" or "B", layer) for nodes in a segment


def _segments(tg: TrainGraph, numbering: Numbering, units: Units) -> Segments:
    fwd = [n for n in tg.forward_nodes() if n.op != "placeholder"]
    marks = [i for i, n in enumerate(fwd) if layer_index(n) is not None]
    if [layer_index(fwd[i]) for i in marks] != list(range(units.traced)):
        raise NotStampable(f"the layer marks are not 0..{units.traced - 1} in order")
    ends = [marks[j] for j in units.ends()]
    forward = [fwd[(ends[i - 1] + 1 if i else 0):ends[i] + 1] for i in range(SEGMENTS)]
    layer_of = {n: ("F", i) for i, seg in enumerate(forward) for n in seg}
    names = dict(zip(tg.placeholders(), tg.names))
    # the mark that ends a segment is the next one's input: the backward nodes that read it belong to the next
    label: dict[fx.Node, int] = {n: i + (n is forward[i][-1]) for n, (_, i) in layer_of.items()}
    for p, name in names.items():
        j = numbering.layer(name)
        if j is not None:
            label[p] = units.small(j)[0]
    backward_nodes, starts = backward_starts(tg, label, SEGMENTS, "the backward does not run layer by layer")
    backward = {SEGMENTS - 1 - k: backward_nodes[starts[k]:starts[k + 1]] for k in range(SEGMENTS - 1)}
    layer_of.update((n, ("B", i)) for i, seg in backward.items() for n in seg)
    return Segments(forward, backward, layer_of)


def backward_starts(tg: TrainGraph, label: dict[fx.Node, int], count: int, refusal: str) -> tuple[list, list[int]]:
    """The backward's nodes, and where segments count-1 .. 0 start among them (the backward runs the last
    first). A backward node belongs to the earliest segment it reads (`label`, given for the forward's
    nodes, gets the backward's too); NotStampable(`refusal`) unless the segments start in that order."""
    fset = tg.forward_set()
    nodes = [n for n in tg.graph.nodes if n not in fset and n.op != "output"]
    first: dict[int, int] = {}
    for at, n in enumerate(nodes):
        reads = [label[a] for a in n.all_input_nodes if a in label]
        if reads:
            label[n] = min(reads)
            first.setdefault(label[n], at)
    starts = [first.get(i, -1) for i in range(count - 1, -1, -1)]
    if sorted(starts) != starts or starts[0] < 0:
        raise NotStampable(refusal)
    return nodes, starts


class Numbering:
    """Layer numbers in tensor names: `{decoder list}.{i}.` (`model.layers.3.mlp.up_proj.weight`)."""

    def __init__(self, layers_name: str):
        self.pattern = re.compile(rf"(?:^|\.){re.escape(layers_name)}\.(\d+)\.")

    def layer(self, name: str) -> int | None:
        m = self.pattern.search(name)
        return int(m[1]) if m else None

    def renumber(self, name: str, to: int) -> str:
        m = self.pattern.search(name)
        assert m is not None, name
        return name[:m.start(1)] + str(to) + name[m.end(1):]


# ---------------------------------------------------------------------------------------------- stamping


class _Stamper:
    """Builds the whole graph in virtual layers (`Units`): `n` of them, 0 the prefix, n-1 the suffix."""

    def __init__(self, small: TrainGraph, prefix: str, units: Units, full: StepInputs):
        self.small, self.units, self.n, self.full = small, units, units.layers, full
        self.name_of = dict(zip(small.placeholders(), small.names))
        self.numbering = Numbering(prefix)
        self.seg = _segments(small, self.numbering, units)
        self.index = {node: i for seg in [*self.seg.forward, *self.seg.backward.values()]
                      for i, node in enumerate(seg)}
        self._check_alike(("F", 1), ("F", 2))
        self._check_alike(("B", 1), ("B", 2))

    # Each argument of a layer's node, by the part it plays; two layers are alike when every node's are equal.
    def _role(self, arg: object, layer: int) -> object:
        if not isinstance(arg, fx.Node):
            j = _mark_layer(arg)
            if j is None:
                return arg
            segment, r = self.units.small(j)
            return (LAYER_MARK, segment - layer, r)
        where = self.seg.layer_of.get(arg)
        if where is None:
            if arg.op == "placeholder":
                name = self.name_of[arg]
                j = self.numbering.layer(name)
                if j is None:
                    return ("param", name)
                segment, r = self.units.small(j)
                return ("param", self.numbering.renumber(name, r), segment - layer)
            return ("shared", arg)
        seg_kind, i = where
        if (seg_kind, i) == ("F", 0) and arg is not self.seg.forward[0][-1]:
            return ("shared", arg)  # the first segment holds what comes before the layers too (rope, masks)
        seg = self._segment(seg_kind, i)
        return (seg_kind, i - layer, self.index[arg] - len(seg))  # counted from the segment's end

    def _roles(self, node: fx.Node, layer: int) -> tuple:
        return node.op, node.target, _mapped((node.args, node.kwargs), lambda a: self._role(a, layer))

    def _segment(self, kind: str, layer: int) -> list[fx.Node]:
        return self.seg.forward[layer] if kind == "F" else self.seg.backward[layer]

    def _check_alike(self, a: tuple[str, int], b: tuple[str, int]) -> None:
        sa, sb = self._segment(*a), self._segment(*b)
        if len(sa) != len(sb):
            raise NotStampable(f"{a} and {b} differ in length")
        for x, y in zip(sa, sb):
            if self._roles(x, a[1]) != self._roles(y, b[1]):
                raise NotStampable(f"layers {a[1]} and {b[1]} differ at {x.name} / {y.name}")

    # ------------------------------------------------------------------ the whole graph
    def graph(self) -> TrainGraph:
        small = self.small
        new = fx.Graph()
        env: dict[tuple[fx.Node, int], fx.Node] = {}  # (small node, the layer it stands for) -> new node
        places = self._placeholders(new)
        order = self._order()
        for node, layer in order:
            copied = env[node, layer] = copy_node(new, node, functools.partial(self._read, at=layer, reader=node,
                                                                                env=env, places=places))
            j = layer_index(node) if node.target is MARK_OP else None
            if j is not None:
                copied.args = (copied.args[0], f"{LAYER_MARK}.{self.units.full(layer, self.units.small(j)[1])}")
        out_small = next(x for x in small.graph.nodes if x.op == "output")
        new.output(self._outputs(out_small, env))
        self._values(new, order, env)
        gm = _LazyGraphModule(small.gm, new)  # its code is made on its first call: a plan never pays for it
        last = next(layer for node, layer in order if node is small.boundary)
        return TrainGraph(gm=gm, roles=self._roles_full(), names=self._names_full(),
                          boundary=env[small.boundary, last], info=small.info)

    def _layer_map(self, i: int, copy: int | None) -> int:
        """The virtual layer a segment stands for: 0, 1 as they are; 2 as the copy; 3 as the last."""
        return {0: 0, 1: 1, 2: copy if copy is not None else 2, 3: self.n - 1}[i]

    def _order(self) -> list[tuple[fx.Node, int]]:
        """Every small-trace node (placeholders aside) with the layer it stands for, in the stamped order."""
        s, n = self.seg, self.n
        order: list[tuple[fx.Node, int]] = []
        f2, b2 = set(s.forward[2]), set(s.backward[2])
        for node in self.small.graph.nodes:
            if node.op in ("placeholder", "output") or node in b2:
                continue
            if node in f2:
                if node is s.forward[2][0]:
                    order += [(x, k) for k in range(2, n - 1) for x in s.forward[2]]
                continue
            order.append(self._key(node, -1))
            if node is s.backward[3][-1]:  # the copies' backward, the top one first
                order += [(x, k) for k in range(n - 2, 1, -1) for x in s.backward[2]]
        return order

    def _read(self, arg: fx.Node, *, at: int, reader: fx.Node, env: dict, places: dict[str, fx.Node]) -> fx.Node:
        """The new node that `reader`, standing for layer `at`, reads for the small-trace node `arg`."""
        if arg.op == "placeholder":
            name = self.name_of[arg]
            j = self.numbering.layer(name)
            if j is not None:
                segment, r = self.units.small(j)
                copied_reader = self.seg.layer_of.get(reader, ("", -1))[1] == 2
                if (segment == 2) != copied_reader and segment != 0:  # a copy reads its own and the prefix's only
                    raise NotStampable(f"{reader.name} reads {name}, another unit's parameter")
                virtual = self._layer_map(segment, at if segment == 2 else None)
                name = self.numbering.renumber(name, self.units.full(virtual, r))
            return places[name]
        where = self.seg.layer_of.get(arg)
        reader_where = self.seg.layer_of.get(reader)
        if reader_where is not None and reader_where[1] == 2 and where is not None and where[1] in (1, 3):
            arg, at = self._neighbour(arg, where, at)  # a copy reads the layer below or above it
            where = self.seg.layer_of.get(arg)
        if where is None or where[1] != 2:
            key = self._key(arg, at)
            if key not in env:
                raise NotStampable(f"{reader.name} reads {arg.name} out of order")
            return env[key]
        # a node of the copied layer: which copy is read follows from the reader's layer and the segments
        if reader_where is not None and reader_where[1] == 2:
            return env[arg, at]  # within one copy
        if reader_where in (("F", 3), ("B", 3)):
            return env[arg, self.n - 2]  # the suffix reads the top copy
        if reader_where == ("B", 1) and where[0] == "B":
            return env[arg, 2]  # layer 1's backward reads the bottom copy's
        raise NotStampable(f"{reader.name} reads the copied layer's {arg.name}")

    def _neighbour(self, arg: fx.Node, where: tuple[str, int], at: int) -> tuple[fx.Node, int]:
        """What copy `at` reads for `arg` of traced unit 1 or the suffix: that node itself when the layer next to
        the copy is the traced one, else the same node (counted from its segment's end) of the next copy. The
        suffix's forward ends in the head, not as a unit does: a copy below the top may not read it."""
        kind, i = where
        to = at + i - 2
        if to == self._layer_map(i, None):
            return arg, to
        if (kind, i) == ("F", SEGMENTS - 1):
            raise NotStampable(f"the copied layer reads the last layer's {arg.name}")
        seg = self._segment(kind, i)
        return self._segment(kind, 2)[self.index[arg] - len(seg)], to

    # ------------------------------------------------------------------ placeholders and outputs
    def _names_full(self) -> list[str]:
        inputs = self.small.names[len(self.small.names) - self._n_inputs():]
        return [*self.full.trainable, *self.full.frozen, *self.full.buffers, *inputs]

    def _n_inputs(self) -> int:
        return sum(r in ("input", "state", "grad") for r in self.small.roles)

    def _roles_full(self) -> list[str]:
        f = self.full
        return (["trainable"] * len(f.trainable) + ["frozen"] * len(f.frozen) + ["buffer"] * len(f.buffers)
                + self.small.roles[len(self.small.roles) - self._n_inputs():])

    def _placeholders(self, new: fx.Graph) -> dict[str, fx.Node]:
        small_vals = {name: p.meta["val"] for p, name in zip(self.small.placeholders(), self.small.names)}
        mode = next(v.fake_mode for v in small_vals.values() if isinstance(v, FakeTensor))
        tensors = {**self.full.trainable, **self.full.frozen, **self.full.buffers}
        places = {}
        for i, name in enumerate(self._names_full()):
            p = new.placeholder(f"arg{i}_1")  # make_fx's names
            t = tensors.get(name)
            p.meta["val"] = small_vals[name] if t is None else t if isinstance(t, FakeTensor) else mode.from_tensor(t)
            places[name] = p
        return places

    def _key(self, node: fx.Node, layer: int) -> tuple[fx.Node, int]:
        """A new node's key: a copied-layer node with the layer it is copied for, any other small-trace node
        with the layer it stands for (-1 outside the layers)."""
        where = self.seg.layer_of.get(node)
        if where is not None and where[1] == 2:
            return node, layer
        return node, self._layer_map(where[1], None) if where else -1

    def _outputs(self, out: fx.Node, env: dict) -> tuple:
        results = [r for r in out.args[0] if isinstance(r, fx.Node)]  # type: ignore[union-attr]
        if len(results) != len(out.args[0]):  # type: ignore[arg-type]
            raise NotStampable("a grad that is not a graph value")
        loss, *grads = results
        by_name = dict(zip(self.small.names, grads))  # trainables come first, in the order of the grads
        new = [env[self._key(loss, -1)]]
        for name in self.full.trainable:
            i = self.numbering.layer(name)
            if i is None:
                g, key = by_name[name], self._key(by_name[name], -1)
            else:
                virtual, r = self.units.virtual(i)
                segment = virtual if virtual <= 1 else SEGMENTS - 1 if virtual == self.n - 1 else 2
                g = by_name[self.numbering.renumber(name, self.units.traced_layer(segment, r))]
                key = self._key(g, virtual)
                if (self.seg.layer_of.get(g, ("", -1))[1] == 2) != (segment == 2):
                    raise NotStampable(f"the grad of {name} is not made by its own layer")
            if key not in env:
                raise NotStampable(f"the grad of {name} is made out of order")
            new.append(env[key])
        return tuple(new)

    def _values(self, new: fx.Graph, order: list[tuple[fx.Node, int]], env: dict) -> None:
        """Fake values: each copy's results in storages of their own, laid out as the original's (as a trace
        would have made them), or in its inputs' where the original's share its inputs' (views, in-place
        results); a traced node that shares the storage of a copy or a placeholder it reads, likewise."""
        original = {env[node, layer]: node for node, layer in order}
        redone = {n for n in new.nodes if n.op == "placeholder"}  # renumbered: a traced view may read another
        for c in new.nodes:
            o = original.get(c)
            if o is None:
                continue
            if (self.seg.layer_of.get(o, ("", -1))[1] == 2
                    or (any(a in redone for a in c.all_input_nodes) and _shares_an_input(o))):
                c.meta["val"] = copied_value(o, c)
                redone.add(c)


def _mark_layer(arg: object) -> int | None:
    """The layer a mark's label names (`l_out.3`: 3), None for any other argument."""
    if isinstance(arg, str) and arg.startswith(f"{LAYER_MARK}.") and arg[len(LAYER_MARK) + 1:].isdigit():
        return int(arg[len(LAYER_MARK) + 1:])
    return None


def _shares_an_input(node: fx.Node) -> bool:
    inputs = {r for a in node.all_input_nodes for r in _storages(a)}
    return any(r in inputs for r in _storages(node))


def _mapped(args: object, fn) -> object:
    """`args` with every leaf mapped by `fn` (nested tuples, lists and dicts as fx keeps them)."""
    if isinstance(args, (tuple, list)):
        return tuple(_mapped(a, fn) for a in args)
    if isinstance(args, dict):
        return tuple((k, _mapped(v, fn)) for k, v in args.items())
    return fn(args)
