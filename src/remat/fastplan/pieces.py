"""The loss head's pieces, stamped (plans only): a step whose loss runs in N pieces (`loss_chunk` tokens each)
is traced with six of them, the first two, a middle one and the last three, and the middle one's forward
and backward are copied for the others, shifted along the window.

Each piece is the same function of the final hidden state at another offset: a slice of it, the model's
head, the cross-entropy against a slice of the labels, a sum into the loss; its backward, in reverse order,
adds into the gradient sums of the head's weight and of the hidden state. Tracing all N of them repeats
that work N times (136 pieces at qwen3.5's 34,816 tokens). The first piece starts the forward's sum and
the last two the backward's, so pieces 1, 2 and N-3 of the small trace are the ones checked to be the same
graph (op for op, each argument playing the same part: its own piece's node, the piece before's, a shared
node, the slice bounds relative to the piece's start), forward and backward. The result is the graph
tracing all N pieces makes, node for node (`tests/test_stamp.py` holds that on every family of the
conformance matrix); anything else raises NotStampable and the step is traced with all its pieces.

A plan needs fewer still (`lumped`): the copies for pieces 2, 3 and N-4 alone, the one for piece 3 standing for
pieces 3 to N-5. A piece's nodes hold what the piece before's held, plus what that one saved for its own
backward, so none of the pieces left out holds more at any node than piece N-4 does; all they add to the others'
nodes is what each saved for its backward, alive from piece N-4's forward to its backward (`plan.lumped`). Its
plans are those of all N pieces, to the byte (`tests/test_stamp.py`), at the cost of eight pieces, not N (qwen3.5's
2,588 at 82,816 tokens)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from remat.core.capture import copied_value
from remat.core.graph import TrainGraph, copy_node, laid_out_on
from remat.core.plan import PIECE
from remat.fastplan.stamp import NotStampable, backward_starts, mapped, shares_an_input
from remat.models.hf import traced_pieces

aten = torch.ops.aten
# The ops that take a position along the window (dim 1): op -> (index of its dim, indexes of its bounds).
_BOUNDS: dict[Any, tuple[int, tuple[int, int]]] = {
    aten.slice.Tensor: (1, (2, 3)), aten.slice_backward.default: (2, (3, 4))}
MIDDLE = 2  # the traced piece that is copied; segments 0, 1 and 3, 4, 5 are the first two and the last three


def stamp(trace: Callable[[], TrainGraph], tokens: int, loss_chunk: int, lumped: bool = False) -> TrainGraph:
    """The step of `trace()` with all its loss pieces, from the trace of six; NotStampable with why. `lumped`:
    only pieces 2, 3 and N-4 copied, for plans (not the whole graph; its plans are)."""
    n = -(-tokens // loss_chunk) if 0 < loss_chunk < tokens else 1
    if n < 8:  # the small trace has six: with fewer than eight, it is most of the whole
        raise NotStampable(f"{n} loss pieces: too few to copy")
    pieces = [0, 1, MIDDLE, n - 3, n - 2, n - 1]
    with traced_pieces(pieces):
        small = trace()
    copies = [MIDDLE, MIDDLE + 1, n - 4] if lumped and n > 8 else list(range(MIDDLE, n - 3))
    return _PieceStamper(small, n, loss_chunk, pieces, copies).graph()


@dataclass
class _Segments:
    forward: list[list[fx.Node]]  # piece s of the small trace, from its slice of the hidden state
    backward: list[list[fx.Node]]  # its backward: from its first node to the next piece's
    where: dict[fx.Node, tuple[str, int]]  # node -> ("F" or "B", segment)


def _bounds(node: fx.Node) -> tuple[int, ...]:
    """The indexes of `node`'s arguments that are positions along the window, if any."""
    dim_bounds = _BOUNDS.get(node.target)
    return dim_bounds[1] if dim_bounds is not None and node.args[dim_bounds[0]] == 1 else ()


def _segments(small: TrainGraph, step: int, pieces: list[int]) -> _Segments:
    fwd = small.forward_nodes()
    slices: dict[fx.Node, list[int]] = {}  # the window slices of each value that is not an input
    for i, n in enumerate(fwd):
        if n.target is aten.slice.Tensor and n.args[1] == 1 and n.args[0].op != "placeholder":  # type: ignore
            slices.setdefault(n.args[0], []).append(i)  # type: ignore[arg-type]
    found = [ix for ix in slices.values() if [fwd[i].args[2] for i in ix] == [k * step for k in pieces]]
    if len(found) != 1:
        raise NotStampable("the loss's pieces are not slices of one hidden state, in order")
    starts = found[0]
    forward = [fwd[a:b] for a, b in itertools.pairwise(starts)]
    forward.append(_piece_of(fwd[starts[-1]:], set(forward[-1])))
    where = {n: ("F", s) for s, seg in enumerate(forward) for n in seg}
    label = {n: s for n, (_, s) in where.items()}
    bwd, order = backward_starts(small, label, len(pieces), "the loss's backward does not run piece by piece")
    backward = [bwd[order[len(pieces) - 1 - s]:(order[len(pieces) - s] if s else len(bwd))]
                for s in range(len(pieces))]
    for s in (1, MIDDLE, 3):  # unlabelled: reads no piece's node (a weight cast where the backward reads it)
        if any(label.get(n, s) != s for n in backward[s]):
            raise NotStampable(f"the backward of piece {pieces[s]} reads another piece's nodes")
    where.update((n, ("B", s)) for s, seg in enumerate(backward) for n in seg)
    return _Segments(forward, backward, where)


def _piece_of(rest: list[fx.Node], before: set[fx.Node]) -> list[fx.Node]:
    """The last piece's nodes among the rest of the forward: what its sum into the loss (the node that reads
    the piece before) is made from; the rest is the loss's (the mean over targets, an aux loss)."""
    within = set(rest)
    todo = [n for n in rest if any(a in before for a in n.all_input_nodes)]
    piece: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in within and n not in piece:
            piece.add(n)
            todo += n.all_input_nodes
    return [n for n in rest if n in piece]


class _PieceStamper:
    """The small trace split by piece, checked, and copied out to all N pieces (`graph`)."""

    def __init__(self, small: TrainGraph, n: int, step: int, pieces: list[int], copies: list[int]):
        self.small, self.n, self.step, self.pieces, self.copies = small, n, step, pieces, copies
        self.left_out = n - 3 - MIDDLE - len(copies)  # pieces stood for by the second copy (`lumped`)
        self.seg = _segments(small, step, pieces)
        self.index = {x: i for segs in (self.seg.forward, self.seg.backward) for seg in segs
                      for i, x in enumerate(seg)}
        for kind in ("F", "B"):
            roles = [[self._roles(x, kind, s) for x in self._segment(kind, s)] for s in (1, MIDDLE, 3)]
            if not roles[0] == roles[1] == roles[2]:
                raise NotStampable(f"the loss's pieces {pieces[1]}, {pieces[2]} and {pieces[3]} differ ({kind})")

    def _segment(self, kind: str, s: int) -> list[fx.Node]:
        return (self.seg.forward if kind == "F" else self.seg.backward)[s]

    def _prev(self, kind: str, s: int) -> tuple[str, int]:
        """The segment a piece's chain continues from: the piece before in the forward, after in the backward."""
        return (kind, s - 1) if kind == "F" else (kind, s + 1)

    def _role(self, a: object, kind: str, s: int) -> object:
        if not isinstance(a, fx.Node):
            return a
        w = self.seg.where.get(a)
        if w is None:
            return ("shared", a)
        at = self.index[a] - len(self._segment(*w))  # counted from its segment's end
        if w == (kind, s):
            return ("own", at)
        if w == ("F", s):
            return ("forward", at)
        if w == self._prev(kind, s):
            return ("prev", at)
        return ("other", w, at)

    def _roles(self, x: fx.Node, kind: str, s: int) -> tuple:
        args: list[Any] = list(x.args)
        for i in _bounds(x):
            args[i] = ("bound", args[i] - self.step * self.pieces[s])
        return x.op, x.target, mapped((args, x.kwargs), lambda a: self._role(a, kind, s))

    # ------------------------------------------------------------------ the whole graph
    def graph(self) -> TrainGraph:
        small, seg = self.small, self.seg
        new = fx.Graph()
        env: dict[tuple[fx.Node, int], fx.Node] = {}  # (small node, the piece it is copied for, -1: itself)
        f2, b2 = set(seg.forward[MIDDLE]), set(seg.backward[MIDDLE])
        copies: dict[fx.Node, tuple[fx.Node, int]] = {}  # new node -> (the small node, piece)
        for node in small.graph.nodes:
            if node in f2 or node in b2:
                kind, segment = ("F", seg.forward[MIDDLE]) if node in f2 else ("B", seg.backward[MIDDLE])
                if node is segment[0]:
                    for k in self.copies if kind == "F" else reversed(self.copies):
                        for x in segment:
                            env[x, k] = self._copy(new, x, k, env)
                            copies[env[x, k]] = (x, k)
            else:
                env[node, -1] = copy_node(new, node, functools.partial(self._read, at=-1, reader=node, env=env))
        self._values(new, env, copies)
        return TrainGraph(gm=_LazyGraphModule(small.gm, new), roles=small.roles, names=small.names,
                          boundary=env[small.boundary, -1], info=small.info, workspaces=small.workspaces)

    def _copy(self, new: fx.Graph, x: fx.Node, k: int, env: dict) -> fx.Node:
        c = copy_node(new, x, functools.partial(self._read, at=k, reader=x, env=env))
        c.meta[PIECE] = (k, self.left_out if k == MIDDLE + 1 else 0)
        if bounds := _bounds(x):
            args: list[Any] = list(c.args)
            c.args = tuple(a + self.step * (k - MIDDLE) if i in bounds else a for i, a in enumerate(args))
        return c

    def _read(self, a: fx.Node, at: int, reader: fx.Node, env: dict) -> fx.Node:
        """The new node that `reader` (copied for piece `at`, or -1: itself) reads for the small node `a`."""
        w, rw = self.seg.where.get(a), self.seg.where.get(reader)
        if w is None or w[1] != MIDDLE:
            if at >= 0 and w is not None and w == self._prev(*rw):  # type: ignore[misc]
                # the first copy reads the traced piece next to it; the others, the copy next to them
                i = self.copies.index(at) + (-1 if w[0] == "F" else 1)
                if 0 <= i < len(self.copies):
                    return env[self._segment(w[0], MIDDLE)[self.index[a]], self.copies[i]]
            return env[a, -1]
        if at >= 0:
            return env[a, at]  # within the copy: its own piece, forward or backward
        if rw == ("F", 3):
            return env[a, self.n - 4]  # piece N-3 continues from the last copy
        if rw == ("B", 1):
            return env[a, MIDDLE]  # piece 1's backward continues from the first copy's
        raise NotStampable(f"{reader.name} reads the middle piece's {a.name}")

    def _values(self, new: fx.Graph, env: dict, copies: dict[fx.Node, tuple[fx.Node, int]]) -> None:
        """Fake values: each copy's as the middle piece's, on storages of its own or its inputs', its views of
        the hidden state and the labels moved along to its piece; a traced node that shares the storage of a
        copy it reads, likewise."""
        shift: dict[fx.Node, int] = {}  # a copy's storage offset minus the middle piece's
        original = {c: node for (node, _), c in env.items()}
        for c in new.nodes:
            o = original[c]
            if c in copies:
                c.meta["val"] = copied_value(o, c)
                shift[c] = self._shift(o, c, shift)
                if shift[c]:
                    v = c.meta["val"]
                    c.meta["val"] = laid_out_on(v, v.untyped_storage(), v.storage_offset() + shift[c])
            elif any(a in copies for a in c.all_input_nodes) and shares_an_input(o):
                c.meta["val"] = copied_value(o, c)

    def _shift(self, o: fx.Node, c: fx.Node, shift: dict[fx.Node, int]) -> int:
        """How far a copy's view lies from the middle piece's: its input's shift, plus the bounds' for a slice."""
        v = o.meta.get("val")
        if not isinstance(v, torch.Tensor) or not o.all_input_nodes:
            return 0
        base = o.all_input_nodes[0]
        b = base.meta.get("val")
        if not isinstance(b, torch.Tensor) or b.untyped_storage()._cdata != v.untyped_storage()._cdata:
            return 0  # not a view of its input: a storage of its own
        moved: Any = shift.get(c.all_input_nodes[0], 0)
        if o.target is aten.slice.Tensor and _bounds(o):
            moved += (c.args[2] - o.args[2]) * b.stride(1)  # type: ignore[operator]
        return moved

