"""Memory: plan a TrainGraph's bytes by category before anything is allocated, and measure a run.

The planner walks the node order with each node's fake tensor (shape, dtype, strides,
storage). A node's output storage is allocated when the node runs and freed after the
last use of any node that aliases it (views and in-place results share their base's
storage). `graph` is the peak of those graph-allocated bytes during forward+backward.
Parameters, inputs and the step's outputs (loss, grads) are counted in their own
categories, never in `graph`; `step` is the peak of graph bytes and grads together (the grads
are made during the backward, after the graph's peak when recompute is off).

The total is what the process holds at its peak: the resident categories plus the larger of
the step with the walk's cache (`step` + `cache`) and the optimizer's update (`grads` + `workspace`), which
never overlap (the walk gives its cache back before the update).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence, Set
from dataclasses import asdict, dataclass

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from remat.base.settings import MiB
from remat.core import devices
from remat.core.graph import TrainGraph, interpret, tensors_in
from remat.core.updates import ADAMW_TEMPORARIES, update_points

HOST = "remat_host"  # node meta: the value lives in host memory beside a device's step (`remat.core.offload`)
PIECE = "remat_piece"  # node meta: a loss piece's copy: (its piece, the pieces left out it stands for) (`lumped`)


@dataclass
class Plan:
    params: int  # trainable parameters
    frozen: int  # frozen parameters and buffers
    grads: int
    optimizer: int  # AdamW: two fp32 states per trainable element (per rank: its ZeRO share)
    graph: int  # peak of graph-allocated tensors during forward + backward
    cache: int = 0  # walk path: KV cache and carried states (exact: their gradient buffers, every chunk's start
    # state), held while the window's chunks run and given back before the optimizer's update
    step: int = 0  # peak of graph-allocated tensors and the grads made by then, together
    workspace: int = 0  # the optimizer's update: AdamW's temporaries, three of its largest parameter (measured)
    trace: int = 0  # the traced graphs and their metadata: the process's growth while tracing (measured)
    runtime: int = 0  # the process before the model: interpreter, torch, libraries (measured, not modelled)
    offload: int = 0  # a device's step: its checkpoints kept in host memory (`remat.core.offload`), at most at once
    device: str = "cpu"  # where the step runs: on a device, `total` is the device's memory and `host` the host's

    @property
    def total(self) -> int:
        """The peak of the memory the step runs in: on the CPU the process's (runtime and trace are in it), on a
        device the device's (they are host memory, with the offloaded checkpoints: `host`). The walk's cache is
        not held through the optimizer's update."""
        resident = self.params + self.frozen + self.optimizer
        if self.device == "cpu":
            resident += self.trace + self.runtime
        return resident + max(self.step + self.cache, self.grads + self.workspace)

    @property
    def host(self) -> int:
        """A device's step: the host memory it holds (the process, the offloaded checkpoints); 0 on the CPU, where
        all of it is in `total`."""
        return 0 if self.device == "cpu" else self.runtime + self.trace + self.offload

    def as_dict(self) -> dict:
        d = {**asdict(self), "total": self.total}
        if self.device == "cpu":  # a CPU plan's figures, as they always were
            del d["offload"], d["device"]
        else:
            d["host"] = self.host
        return d


Lives = dict[Hashable, tuple[int, int, int]]  # storage -> (position of its maker, bytes, position it is freed after)


def value_bytes(value: object) -> int:
    """The bytes of the storages a value holds, each once."""
    return sum({StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors_in(value)}.values())


class _HeldInside(TorchDispatchMode):
    """The peak of the bytes of the storages made while it is on (inputs' aside). Each op's outputs are
    counted once per storage; before each op, storages nothing holds any more (`StorageWeakRef.expired`: a
    weak reference, which keeps nothing alive, so autograd still reuses what it may) are dropped. Fake and
    real tensors alike."""

    def __init__(self, inputs: Sequence[object]):
        super().__init__()
        self.inputs = {StorageWeakRef(t.untyped_storage()) for t in tensors_in(list(inputs))}
        self.sizes: dict[StorageWeakRef, int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for key in [k for k in self.sizes if k.expired()]:
            self.live -= self.sizes.pop(key)
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            key = StorageWeakRef(t.untyped_storage())
            if key not in self.inputs and key not in self.sizes:
                self.sizes[key] = t.untyped_storage().nbytes()
                self.live += self.sizes[key]
        self.peak = max(self.peak, self.live)
        return out


_WATCHING: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("remat_held_inside", default=None)


@contextlib.contextmanager
def watching(peaks: list[int]) -> Iterator[None]:
    """Ops that hold memory inside (`TrainGraph.workspaces`) append their internal peaks to `peaks` while this is on."""
    token = _WATCHING.set(peaks)
    try:
        yield
    finally:
        _WATCHING.reset(token)


def held_inside(fn: Callable[[], object], inputs: Sequence[object]) -> object:
    """`fn()`: an op's body. While someone is `watching`, its internal peak (bytes made inside, its result
    included, `inputs` aside) is appended to what they watch."""
    peaks = _WATCHING.get()
    if peaks is None:
        return fn()
    token = _WATCHING.set(None)  # an op inside reports to this one, not past it
    try:
        with _HeldInside(inputs) as seen:
            out = fn()
    finally:
        _WATCHING.reset(token)
    peaks.append(seen.peak)
    return out


def sized_storages(node: fx.Node) -> list[tuple[StorageWeakRef, int]]:
    """The storages the node's value holds, with their bytes."""
    return [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
            for t in tensors_in(node.meta.get("val"))]


def storages_of(node: fx.Node) -> list[StorageWeakRef]:
    return [s for s, _ in sized_storages(node)]


def _output_nodes(graph: fx.Graph) -> list[fx.Node]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    return list(out.all_input_nodes)


def lives(held: Sequence[Sequence[tuple[Hashable, int]]], last_read: Sequence[int], inputs: Set,
          outputs: Set, inside: Sequence[int] = ()) -> Lives:
    """Each graph-allocated storage's life over a node order: `held[i]`, the storages node i's value holds
    (with bytes); `last_read[i]`, the position of its last reader (or i). `inputs` are not the graph's to
    allocate; `outputs` live from their maker to the end. `inside[i]`: what node i holds while it runs
    beyond its value (`workspace`), alive at i only."""
    life: Lives = {("inside", i): (i, size, i) for i, size in enumerate(inside) if size}
    for i, (storages, end) in enumerate(zip(held, last_read, strict=True)):
        for s, size in storages:
            if s not in inputs:
                maker, first_size, freed = life.get(s, (i, size, 0))
                life[s] = (maker, first_size, len(held) if s in outputs else max(freed, end))
    return life


def lumped(life: Lives, pieces: Sequence[tuple[int, int] | None]) -> Lives:
    """`life` with the loss pieces a plan's stamp left out (`fastplan.pieces`; `pieces[i]`: node i's `PIECE`). From
    the first node of the copy after the one standing for `more` of them to its last, they hold what each saved for
    its backward: what the copy standing for them made in its forward and freed in its backward, `more` times."""
    own = {i for i, p in enumerate(pieces) if p is not None and p[1]}
    if not own:
        return life
    piece, more = pieces[min(own)]  # type: ignore[misc]
    after = [i for i, p in enumerate(pieces) if p is not None and p[0] > piece]
    saved = sum(size for maker, size, end in life.values() if maker in own and end in own and maker < after[0] < end)
    return {**life, ("lumped", piece): (after[0], more * saved, after[-1])} if saved else life


def in_backward(order: Order, held: Sequence[Sequence[tuple[Hashable, int]]], before_output: Sequence[int],
                grads: Sequence[int], params: Sequence[int]) -> Order:
    """`order` with the optimizer in the backward: an update after each position `updates.update_points` names
    (a position of its own between two nodes: what the node there read last is freed first, as the graph that runs
    frees it), holding AdamW's temporaries of its parameter, and each gradient's storages given back after it.
    `held`, `before_output`: the order's storages and last readers (the step's output aside); `grads`, `params`:
    each trainable's gradient and placeholder positions."""
    count, life, outputs = order
    twice: Lives = {s: (2 * maker, size, 2 * end) for s, (maker, size, end) in life.items()}
    ends: dict[Hashable, int] = {}
    for k, (g, p, at) in enumerate(zip(grads, params, update_points(held, before_output, grads, params))):
        for s, _ in held[g]:
            ends[s] = max(ends.get(s, 0), 2 * at + 1)
        twice["update", k] = (2 * at + 1, ADAMW_TEMPORARIES * sum(size for _, size in held[p]), 2 * at + 1)
    for s, end in ends.items():
        if s in twice:
            twice[s] = (*twice[s][:2], end)
    return 2 * count, twice, outputs


def _lifetimes(tg: TrainGraph, updates: bool = False) -> tuple[list[fx.Node], Lives, set]:
    """The graph's node order, its storages' lives (`lives`), and which of them are the step's outputs; with
    `updates`, the optimizer in the backward (`in_backward`)."""
    nodes = list(tg.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    held = [sized_storages(n) for n in nodes]
    # the graph does not allocate its inputs; a value kept in host memory (offload) is not the step's memory
    inputs = {s for n in nodes if n.op == "placeholder" or n.meta.get(HOST) for s, _ in held[pos[n]]}
    results = _output_nodes(tg.graph)
    outputs = {s for n in results for s, _ in held[pos[n]]} - inputs
    last_read = [max([i] + [pos[u] for u in n.users]) for i, n in enumerate(nodes)]
    life = lumped(lives(held, last_read, inputs, outputs, [tg.workspace(n) for n in nodes]),
                  [n.meta.get(PIECE) for n in nodes])
    if updates:
        before = [max([i] + [pos[u] for u in n.users if u.op != "output"]) for i, n in enumerate(nodes)]
        params = [pos[n] for n, r in zip(tg.placeholders(), tg.roles) if r == "trainable"]
        _, life, _ = in_backward((len(nodes), life, outputs), held, before, [pos[n] for n in results[1:]], params)
        nodes = [x for n in nodes for x in (n, n)]  # each position twice: the updates go between two nodes
    return nodes, life, outputs


def _peaks(count: int, life: Lives, outputs: Set) -> tuple[int, int]:
    """The peak of live bytes without the `outputs` (`graph`) and with them (`step`), in one pass that does not keep
    what is live: a plan needs only the two figures."""
    made, freed = [0] * (count + 1), [0] * (count + 1)  # all storages' bytes, made and freed at each position
    made_out, freed_out = [0] * (count + 1), [0] * (count + 1)  # the outputs' alone
    for s, (maker, size, end) in life.items():
        made[maker] += size
        freed[end] += size
        if s in outputs:
            made_out[maker] += size
            freed_out[end] += size
    graph = step = total = out = 0
    for i in range(count):
        total += made[i]
        out += made_out[i]
        step, graph = max(step, total), max(graph, total - out)
        total -= freed[i]
        out -= freed_out[i]
    return graph, step


def _made_grads(tg: TrainGraph) -> int:
    """Bytes of the step's grads (its outputs after the loss) that the graph allocates; the rest alias its
    inputs (a walk's grad sums)."""
    inputs = {s for n in tg.placeholders() for s in storages_of(n)}
    made = {s: size for n in _output_nodes(tg.graph)[1:] for s, size in sized_storages(n) if s not in inputs}
    return sum(made.values())


Order = tuple[int, Lives, Set]  # a node order: its length, its storages' `lives`, its outputs' storages


def plan(tg: TrainGraph, order: Order | None = None, updates: bool = False) -> Plan:
    """Bytes by category for running `tg` as a training step with AdamW. `order`, when given, is another
    node order of the same step: a rewrite planned without making its graph (`recompute.Rewriter.plan`).
    `updates`: the optimizer runs in the backward (`in_backward`; `order` then made so too)."""
    if order is None:
        nodes, lifetimes, made_outputs = _lifetimes(tg, updates)  # one walk over the storages for both peaks
        order = len(nodes), lifetimes, made_outputs
    inputs = [(r, n.meta.get("val")) for n, r in zip(tg.placeholders(), tg.roles)]
    return dataclasses.replace(planned(inputs, _made_grads(tg), order, tg.info, updates), offload=host_bytes(tg))


def host_bytes(tg: TrainGraph) -> int:
    """The bytes of the values the step keeps in host memory (`HOST` nodes: a device's offloaded checkpoints),
    each storage once: they are all alive between the forward's last copy out and the backward's first copy in."""
    return sum({s: size for n in tg.graph.nodes if n.meta.get(HOST) for s, size in sized_storages(n)}.values())


def placed(p: Plan, device: torch.device) -> Plan:
    """`p` for a step on `device`: on an accelerator its memory is split from the host's (`Plan.host`), and AdamW
    updates in place (`devices.optimizer_workspace`)."""
    if devices.is_host(device):
        return p
    largest = p.workspace // 3  # planned as the CPU's single-tensor AdamW: three of the largest parameter
    return dataclasses.replace(p, device=str(device), workspace=devices.optimizer_workspace(device, largest))


def planned(inputs: Sequence[tuple[str, object]], made_grads: int, order: Order, info: dict,
            updates: bool = False) -> Plan:
    """The plan of a step from its inputs' roles and values, the bytes of the grads it makes (`_made_grads`),
    its node order and its `info` (`plan`'s parts, for a step planned without its graph). `updates`: the optimizer
    runs in the backward, each update inside `step` (its order made so): no set of grads, no update after it."""
    trainable = [t for r, v in inputs if r == "trainable" for t in tensors_in(v)]
    params = sum(t.numel() * t.element_size() for t in trainable)
    largest = max((t.numel() * t.element_size() for t in trainable), default=0)

    def role_bytes(*roles: str) -> int:
        return sum(t.untyped_storage().nbytes() for r, v in inputs if r in roles for t in tensors_in(v))

    graph, step = _peaks(*order)
    return Plan(
        params=params,
        frozen=role_bytes("frozen", "buffer"),
        grads=0 if updates else params,
        optimizer=2 * 4 * sum(t.numel() for t in trainable),
        graph=graph,
        cache=role_bytes("state") + info.get("saved_states", 0),
        step=step + max(0, params - made_grads),  # with the grads held before the step starts (a walk's sums)
        # torch's single-tensor AdamW (CPU): sqrt, quotient and sum of one parameter; in the backward, in `step`
        workspace=0 if updates else 3 * largest,
    )


class Storages:
    """Makes a step as the planner sees it, node by node, without a graph: each node's storages (with bytes)
    and its last reader, in order (`recompute.Rewriter.plan`, `stamp`'s plans). A copy of a node holds its
    original's storages, or new ones of the same sizes (`new`: a value made again by the same op); where the
    original holds an input's storage (a view, an in-place write), the copy holds that input's copy's instead."""

    def __init__(self, storages: Callable[[fx.Node], Sequence[tuple[Hashable, int]]],
                 workspace: Callable[[fx.Node], int], templates: dict | None = None):
        self.storages = storages  # an original node's, in the order its value holds them
        self.workspace = workspace  # an original node's (`TrainGraph.workspace`)
        self.held: list[list[tuple[Hashable, int]]] = []
        self.last_read: list[int] = []
        self.inside: list[int] = []  # what each node holds while it runs beyond its value (`workspace`)
        self.pieces: list[tuple[int, int] | None] = []  # each node's loss piece, where a copy of one (`lumped`)
        self.inputs: set[Hashable] = set()
        self.grads: list[tuple[Hashable, int]] = []  # what the step's outputs after the loss hold
        self.outputs: set[Hashable] = set()
        self.results: list[int] = []  # the positions of the step's outputs: the loss, then the grads
        self.placeholders: list[int] = []  # the positions of the step's inputs, in order
        self.before_output: list[int] = []  # each node's last reader, the step's output aside
        self.templates = {} if templates is None else templates  # see `_template`; shared by walks of one step

    def input(self, key: Hashable, size: int = 0) -> int:
        """A placeholder of its own (not an original's copy): its one storage is `key`, of `size` bytes."""
        self.inputs.add(key)
        self.placeholders.append(len(self.held))
        return self._append([(key, size)], 0)

    def copy(self, n: fx.Node, arg: Callable[[fx.Node], int], new: bool = False) -> int:
        if n.op == "output":
            return self.output([arg(a) for a in n.all_input_nodes])
        i = len(self.held)
        read = [arg(a) for a in n.all_input_nodes]
        for h in read:
            self.last_read[h] = i
        own, inside = self._template(n)
        # keys of one type: (-1, its storage) for an original's, (i, the original's) for node i's new one
        mine = i if new else -1
        self._append([(self.held[read[k]][j][0] if k >= 0 else (mine, s), size) for s, size, k, j in own], inside,
                     n.meta.get(PIECE))
        if n.op == "placeholder":
            self.inputs.update(s for s, _ in self.held[i])
            self.placeholders.append(i)
        return i

    def _template(self, n: fx.Node) -> tuple[list[tuple[Hashable, int, int, int]], int]:
        """An original's storages, each with where an input holds it (the input's place among the node's
        inputs, and the storage's among that input's; the last such, else -1, -1), and its `workspace`: the
        same for every copy of it."""
        if n not in self.templates:
            where = {s: (k, j) for k, a in enumerate(n.all_input_nodes) for j, (s, _) in enumerate(self.storages(a))}
            own = [(s, size, *where.get(s, (-1, -1))) for s, size in self.storages(n)]
            self.templates[n] = own, self.workspace(n)
        return self.templates[n]

    def clone(self, n: fx.Node, arg: Callable[[fx.Node], int], layer: int | None) -> int:
        return self.copy(n, arg, new=True)

    def output(self, results: list[int]) -> int:
        """The step's output node: the loss, then the grads (positions of the nodes that make them)."""
        i = self._append([], 0)
        self.before_output, self.results = list(self.last_read), results
        for h in results:
            self.last_read[h] = i
        self.outputs = {s for h in results for s, _ in self.held[h]}
        self.grads = [held for h in results[1:] for held in self.held[h]]
        return i

    def order(self, updates: bool = False) -> Order:
        """The node order made (`updates`: with the optimizer in the backward, `in_backward`)."""
        outputs = self.outputs - self.inputs
        life = lumped(lives(self.held, self.last_read, self.inputs, outputs, self.inside), self.pieces)
        order = len(self.held), life, outputs
        if not updates:
            return order
        grads = self.results[1:]
        return in_backward(order, self.held, self.before_output, grads, self.placeholders[:len(grads)])

    def made_grads(self) -> int:
        return sum({s: size for s, size in self.grads if s not in self.inputs}.values())

    def _append(self, held: list[tuple[Hashable, int]], inside: int, piece: tuple[int, int] | None = None) -> int:
        self.held.append(held)
        self.last_read.append(len(self.held) - 1)
        self.inside.append(inside)
        self.pieces.append(piece)
        return len(self.held) - 1


def rank_share(p: Plan, numels: list[int], world_size: int) -> Plan:
    """`p` for one of `world_size` data-parallel ranks: its optimizer holds the largest ZeRO share of the state
    of trainable tensors of `numels` elements."""
    return dataclasses.replace(p, optimizer=2 * 4 * max(zero_shards(numels, world_size)))


def zero_shards(numels: list[int], world_size: int) -> list[int]:
    """Elements of optimizer state per rank as ZeroRedundancyOptimizer partitions them: whole tensors,
    largest first, each to the rank holding the least so far (one process: all of them)."""
    sizes = [0] * world_size
    for n in sorted(numels, reverse=True):
        sizes[sizes.index(min(sizes))] += n
    return sizes


@dataclass
class Measured:
    graph: int  # peak live bytes of graph-allocated storages, observed
    step: int = 0  # the same with the grads: those the step makes, as it makes them, and those it was given
    cuda_max_allocated: int | None = None  # the caching allocator's peaks over the step: in use,
    cuda_max_reserved: int | None = None  # and held from the driver (blocks, rounding, fragmentation)

    def as_dict(self) -> dict[str, int]:
        d = {"graph": self.graph, "step": self.step}
        if self.cuda_max_allocated is not None:
            d["cuda_max_allocated"] = self.cuda_max_allocated
        if self.cuda_max_reserved is not None:
            d["cuda_max_reserved"] = self.cuda_max_reserved
        return d


def measure(tg: TrainGraph, args: list[torch.Tensor]) -> tuple[list, Measured]:
    """Run the step once, tracking real storages as they are made and dropped.

    Returns the graph's outputs and the observed peak of graph-allocated bytes, with
    inputs and the step's outputs (loss, grads) left out exactly as the planner does.
    """
    inputs = {t.untyped_storage().data_ptr() for t in args}
    refs: dict[int, int] = {}  # storage data_ptr -> live values holding it
    ident: dict[int, int] = {}  # storage data_ptr -> allocation id (pointers get reused)
    events: list[tuple[int, int]] = []  # (allocation id, +bytes / -bytes), in order
    counter = iter(range(1 << 62))

    inside: list[int] = []  # what the last node held inside beyond its value (`held_inside`)
    updated: dict[int, int] = {}  # with the optimizer in the backward: the grads updates took (allocation: bytes)

    def made(node: fx.Node, value: object, env: dict) -> None:
        if node.op == "call_module" and tg.info.get("updates"):  # an update, (k, grad): the grad counts as an output
            storage = env[node.args[1]].untyped_storage()
            if (p := storage.data_ptr()) in ident:
                updated[ident[p]] = storage.nbytes()
        for t in tensors_in(value) if not node.meta.get(HOST) else ():  # host memory: not the step's
            p = t.untyped_storage().data_ptr()
            if p in inputs or t.untyped_storage().nbytes() == 0:
                continue
            if refs.get(p, 0) == 0:
                ident[p] = next(counter)
                events.append((ident[p], t.untyped_storage().nbytes()))
            refs[p] = refs.get(p, 0) + 1
        extra = max(0, inside.pop() - value_bytes(value)) if inside else 0
        events.append((-2, extra))  # a sampling point: after each node, before frees
        events.append((-2, -extra))

    def freed(node: fx.Node, value: object) -> None:
        for t in tensors_in(value):
            p = t.untyped_storage().data_ptr()
            if p not in refs:
                continue
            refs[p] -= 1
            if refs[p] == 0:
                del refs[p]
                events.append((ident[p], -t.untyped_storage().nbytes()))

    cuda = any(t.is_cuda for t in args)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with watching(inside):
        outputs = interpret(tg.gm, args, on_node=made, on_free=freed)
    outs = {ident[p] for t in tensors_in(outputs) if (p := t.untyped_storage().data_ptr()) in ident}
    outs |= set(updated)
    made_grads = sum({p: t.untyped_storage().nbytes() for t in tensors_in(outputs[1:])
                      if (p := t.untyped_storage().data_ptr()) not in inputs}.values())  # grads may share one
    made_grads += sum(updated.values())
    held = sum(a.numel() * a.element_size() for a, r in zip(args, tg.roles) if r == "trainable") - made_grads
    if cuda:
        torch.cuda.synchronize()
    peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if cuda else (None, None)
    return outputs, Measured(graph=_peak(events, skip=outs), step=_peak(events) + max(0, held),
                             cuda_max_allocated=peaks[0], cuda_max_reserved=peaks[1])


def _peak(events: list[tuple[int, int]], skip: frozenset[int] | set[int] = frozenset()) -> int:
    live = peak = 0
    for i, b in events:
        if i not in skip:
            live += b
            peak = max(peak, live)
    return peak


def mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"
