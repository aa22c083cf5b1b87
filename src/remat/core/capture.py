"""Capture: trace one whole training step (forward, loss, backward) into a TrainGraph.

`make_fx` records the aten ops of a step that computes the loss and calls
`torch.autograd.grad`, so forward and backward land in one fx graph, in the order
they ran. The forward/backward boundary is the last node recorded before the
backward starts; it is read off the tracer at that moment, not guessed later.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple, cast

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from remat.core import tied
from remat.core.graph import StepInputs, TrainGraph, Workspaces, laid_out_on, tensors_in


class Unrecordable(Exception):
    """A recorder (`trace`'s `recorder`) cannot follow this step: make_fx traces it instead."""


# A faster tracer than make_fx: `fn(*args)` recorded as make_fx would record it, or Unrecordable. The
# recorder's dispatch mode answers `last_node()` while it records.
Recorder = Callable[[Callable[..., tuple], Sequence[torch.Tensor]], fx.GraphModule]


def trace(model: nn.Module, loss_fn, inputs: dict[str, tuple[str, torch.Tensor]], *,
          info: dict | None = None, accumulate: bool = False, recorder: Recorder | None = None,
          workspaces: Workspaces | None = None) -> TrainGraph:
    """Trace `loss_fn(model, *inputs)` and the grads of the trainable parameters into a TrainGraph.

    `inputs` maps a name to (role, example tensor): "input" for batch data, "state" for
    buffers the step reads and writes in place (the walk's caches). Placeholders are the
    model's trainable, frozen and buffer tensors, then the inputs in order. With `accumulate`,
    one more placeholder per trainable (role "grad", after the inputs) is the gradient sum of the
    steps before (the walk's chunks): the step adds each gradient into it as the backward makes it
    and returns these sums as its grads, so no second set of grads is ever alive.

    The step is recorded by `recorder` where one is given (the same graph as make_fx's, faster:
    `remat.fastplan.record`), else traced by make_fx. `workspaces` names the ops
    of the step that hold memory inside beyond their outputs; the graph carries them to the planner. Preparing
    the model (its marks, its attention) is the caller's.
    """
    tensors = StepInputs.of(model)
    if not tensors.trainable:
        raise ValueError("the model has no trainable parameters")
    model_names = [*tensors.trainable, *tensors.frozen, *tensors.buffers]
    sum_names = [f"grad.{k}" for k in tensors.trainable] if accumulate else []
    roles = (["trainable"] * len(tensors.trainable) + ["frozen"] * len(tensors.frozen)
             + ["buffer"] * len(tensors.buffers) + [role for role, _ in inputs.values()] + ["grad"] * len(sum_names))
    n_train, n_model, n_in = len(tensors.trainable), len(model_names), len(inputs)
    boundary: list[fx.Node] = []

    def step(*args: torch.Tensor):
        sums = args[n_model + n_in:]
        # each parameter's gradient goes into its sum as soon as it is made; the hooks go with the step (a
        # fake model's parameters are the step's inputs themselves, and the next trace must not find them);
        # a tied one's, use by use (`tied.each_use`)
        hooks = [p.register_hook(into(g)) for p, g in zip(args[:n_train], sums)]
        try:
            with tied.each_use(model, {k: into(g) for k, g in zip(tensors.trainable, sums)}) as uses:
                state = {f"model.{k}": v for k, v in zip(model_names, args[:n_model])}
                out = torch.func.functional_call(_LossModule(model, loss_fn), state, args[n_model:n_model + n_in])
            seeded = out if isinstance(out, Seeded) else Seeded(out)
            boundary.append(_last_node())  # the forward's last node
            # with sums, the grads returned are not read: a parameter whose every use was a leaf of its own gets
            # none, and zeros made for it would be a parameter's size for nothing
            grads = torch.autograd.grad([seeded.loss, *seeded.outputs], [*args[:n_train], *seeded.sinks, *uses],
                                        grad_outputs=[None, *seeded.cotangents], allow_unused=True,
                                        materialize_grads=not uses)
        finally:
            for hook in hooks:
                hook.remove()
        return (seeded.loss, *(sums or grads[:n_train]))

    example = _fake_inputs(tensors.args(*(t for _, t in inputs.values())), len(sum_names))
    # a lazy module makes its Python code on its first call: a trace that is only planned never pays for it
    with torch.enable_grad(), cast(FakeTensor, example[0]).fake_mode, _use_lazy_graph_module(True):
        gm = _recorded(recorder, step, example) if recorder is not None else None
        if gm is None:
            del boundary[:]
            # no torch-function metadata mode: it only names each node's torch call in its meta (read by nothing)
            gm = make_fx(step, _disable_torch_fn_metadata_mode=True)(*example)
    sum_in_place(gm, boundary[0])
    return TrainGraph(gm=gm, roles=roles, names=[*model_names, *inputs, *sum_names], boundary=boundary[0],
                      info=info or {}, workspaces=workspaces or {})


def _fake_inputs(example: list[torch.Tensor], sums: int) -> list[torch.Tensor]:
    """The step's arguments as fake tensors (a model built under a fake mode brings its own), the first `sums`
    again as zeroed gradient sums at the end."""
    if len({id(t) for t in example}) != len(example):
        raise ValueError("each input must be its own tensor (make_fx merges repeated inputs)")
    mode = next((t.fake_mode for t in example if isinstance(t, FakeTensor)), None)
    mode = mode or EagerStridesFakeMode(allow_non_fake_inputs=True)
    fakes: list[torch.Tensor] = [t if isinstance(t, FakeTensor) else mode.from_tensor(t) for t in example]
    with mode:
        fakes += [torch.zeros_like(t) for t in fakes[:sums]]
    return fakes


def _recorded(recorder: Recorder, step: Callable, example: list[torch.Tensor]) -> fx.GraphModule | None:
    """The step recorded, or None where the recorder cannot follow it."""
    try:
        return recorder(step, example)
    except Unrecordable:
        return None


def _last_node() -> fx.Node:
    """The node recorded last by the tracer running: a recorder's mode, or make_fx's."""
    mode = next((m for m in _get_current_dispatch_mode_stack() if hasattr(m, "last_node")), None)
    if mode is not None:
        return mode.last_node()
    proxy = get_proxy_mode()
    assert proxy is not None, "called while a step is traced"
    return next(reversed(proxy.tracer.graph.nodes))


def sum_in_place(gm: fx.GraphModule, boundary: fx.Node) -> int:
    """Turn the backward's gradient sums `add(a, b)` into `a.add_(b)` where nothing reads `a`'s storage again,
    as eager autograd's InputBuffer does: make_fx's tracer holds a reference to every value, so autograd
    never finds a sum it may reuse and records a new tensor for each (SmolLM2's tied head summed its
    weight's gradient over the loss's pieces with three vocab-sized tensors alive, not two). The same
    kernel on the same operands: the result is bitwise the same. Returns how many sums now run in place.

    Storages come from the fake values, as the planner sees them. `a`'s storage must be made in the
    backward, read by nothing after the sum (the step's output included) and laid out exactly as the sum,
    so the sum and its views move onto `a`'s storage, shifted by its offset."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    holders: dict[StorageWeakRef, list[fx.Node]] = {}
    for n in nodes:
        for t in tensors_in(n.meta.get("val")):
            holders.setdefault(StorageWeakRef(t.untyped_storage()), []).append(n)
    end = {s: max(pos[u] for n in held for u in (n, *n.users)) for s, held in holders.items()}
    backward = pos[boundary] + 1
    count = 0
    for n in nodes[backward:]:
        if n.target is not torch.ops.aten.add.Tensor or not isinstance(n.args[0], fx.Node):
            continue
        a, out = n.args[0].meta.get("val"), n.meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor)):
            continue
        s, r = StorageWeakRef(a.untyped_storage()), StorageWeakRef(out.untyped_storage())
        others = {StorageWeakRef(t.untyped_storage())
                  for b in n.all_input_nodes[1:] for t in tensors_in(b.meta.get("val"))}
        if (pos[holders[s][0]] < backward or end[s] != pos[n] or s in others or r == s
                or (a.shape, a.stride(), a.dtype, a.device) != (out.shape, out.stride(), out.dtype, out.device)):
            continue
        n.target = torch.ops.aten.add_.Tensor
        shift = a.storage_offset() - out.storage_offset()
        for h in holders.pop(r):  # the sum and its views, now on `a`'s storage
            h.meta["val"] = _moved(h.meta["val"], r, a.untyped_storage(), shift)
            holders[s].append(h)
        end[s] = end.pop(r)
        count += 1
    gm.recompile()
    return count


def _moved(value: object, old: StorageWeakRef, storage: torch.UntypedStorage, shift: int | torch.SymInt) -> object:
    """`value` with its tensors on storage `old` laid out the same on `storage`, `shift` elements further."""
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, old, storage, shift) for v in value)
    if not isinstance(value, torch.Tensor) or StorageWeakRef(value.untyped_storage()) != old:
        return value
    moved = laid_out_on(value, storage, value.storage_offset() + shift)
    return FakeTensor(value.fake_mode, moved, value.device) if isinstance(value, FakeTensor) else moved


class Seeded(NamedTuple):
    """A loss whose step's gradient reaches past the loss (the exact walk's chunk, `remat.training.walk`).

    `outputs` are values the step makes whose gradient arrives from outside it (`cotangents`, added
    to the loss's); `sinks` are inputs whose gradient leaves the step (through their `into` hooks,
    into the step's buffers, in place).
    """

    loss: torch.Tensor
    outputs: tuple[torch.Tensor, ...] = ()
    cotangents: tuple[torch.Tensor, ...] = ()
    sinks: tuple[torch.Tensor, ...] = ()


def into(buffer: torch.Tensor, *, add: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook: the gradient goes into `buffer` (added, or copied) the moment autograd makes it, and
    what flows on is a zero that takes no memory (an expanded scalar). Registered on a step's leaves, their
    gradients leave the step in place, one at a time, instead of all living until the step's end."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if add:
            buffer.add_(grad)
        else:
            buffer.copy_(grad)
        return grad.new_zeros(()).expand_as(grad)

    return hook


class EagerStridesFakeMode(FakeTensorMode):
    """Fake tensors laid out the way the real CPU kernels lay them out.

    A few of PyTorch's fake kernels are Python decompositions whose output strides
    differ from the eager kernel's (`softplus_backward` follows its second operand,
    eager follows the first). A traced `reshape` then becomes a `view` that fails at
    run time, or a copy eager never made. `tests/test_capture.py` checks every node's
    strides against a real run, so a new mismatch shows up there.
    """

    _same_layout_as: ClassVar[dict] = {
        # pointwise binary op on (grad_output, self): eager's TensorIterator layout
        torch.ops.aten.softplus_backward.default: torch.ops.aten.mul.Tensor,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self._same_layout_as:
            with self:
                return self._same_layout_as[func](args[0], args[1])
        return super().__torch_dispatch__(func, types, args, kwargs)


def copied_value(original: fx.Node, copy: fx.Node) -> object:
    """The value of `copy`, a node computing what `original` computes on inputs laid out as its inputs
    (a recompute clone, a layer stamped again): `original`'s layouts, on the storages of `copy`'s inputs
    where `original`'s are its inputs' (views, in-place results), else on new ones (`laid_out_on`).

    Made on the meta device directly, not by running the op's fake kernel again: that gave the same
    layouts at several times the cost, and was most of a rewrite's time.
    """
    if original.target is operator.getitem:
        return copy.args[0].meta["val"][copy.args[1]]  # type: ignore[union-attr]
    val, sources = original.meta["val"], _storage_sources(original)
    inputs = [t for a in copy.all_input_nodes for t in tensors_in(a.meta.get("val"))]
    made: dict[tuple[int], torch.UntypedStorage] = {}  # a new storage of the original's -> the copy's

    def one(t: object, source: int | tuple[int]) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        if isinstance(source, int):
            return laid_out_on(t, inputs[source].untyped_storage(), t.storage_offset())
        if source not in made and t.storage_offset() == 0:  # one whole new storage: made with its tensor
            copied = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if copied.untyped_storage().nbytes() == t.untyped_storage().nbytes():
                made[source] = copied.untyped_storage()
                return copied
        if source not in made:
            made[source] = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8,
                                       device="meta").untyped_storage()
        return laid_out_on(t, made[source], t.storage_offset())

    if isinstance(val, (tuple, list)):
        return type(val)(map(one, val, sources))
    return one(val, sources[0])


_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _storage_sources(original: fx.Node) -> list[int | tuple[int]]:
    """For each element of the node's value, where its storage comes from: an input tensor's (its position
    among the node's input tensors, in order), or a new one, `(k,)`, one k per new storage (results may share
    one). Worked out once per node (a stamped layer's node is copied once per layer of its type): every copy of
    it is laid out the same."""
    if original not in _sources:
        held: dict[StorageWeakRef, int | tuple[int]] = {}
        inputs = [t for a in original.all_input_nodes for t in tensors_in(a.meta.get("val"))]
        for i, t in enumerate(inputs):
            held.setdefault(StorageWeakRef(t.untyped_storage()), i)
        val = original.meta["val"]
        sources: list[int | tuple[int]] = []
        for t in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                sources.append(held.setdefault(ref, (len(held),)))
            else:
                sources.append(-1)
        _sources[original] = sources
    return _sources[original]


class _LossModule(nn.Module):
    # functional_call swaps tensors on a module's whole tree; this makes the loss one call.
    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, *inputs)
