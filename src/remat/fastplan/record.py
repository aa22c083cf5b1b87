"""A lean recorder of a step: the graph make_fx records, in under half its time.

The planner records every step it traces: a real model's, which then runs, and one's on fake weights, only
planned, for the values' layouts and the ops between them. make_fx wraps every value in a proxy, snapshots and
describes it twice (`val`, `tensor_meta`), and maps every argument tree through pytree: about a third of a trace
beside the fake kernels themselves. `record` is a TorchDispatchMode that keeps the same graph directly: one node
per op in the order it ran, `getitem`s for each element of a tuple result, `_tensor_constant`s for tensors the
step did not make, lift_fresh recorded as lift_fresh_copy, CompositeImplicit ops decomposed where autograd would
have, constants folded where make_fx folds them; each node's `meta["val"]` its value as it was then, as
make_fx's `val`, but a meta tensor on the value's storage (`_snapshot`), not a fake copy (and no `tensor_meta`,
which nothing here reads).

`tests/test_stamp.py` holds it to make_fx node for node (op, target, arguments, layouts, storages) on every
family of the conformance matrix (the small trace recorded and stamped, as the planner does, against make_fx's
whole trace), `tests/test_record.py` on the walk's chunk steps, and `tests/test_conformance.py` trains every
family from a saved folder (`finetune`: the step recorded) to the losses of the step make_fx traced, bit for
bit. A step the recorder cannot follow raises `Unrecordable` and is traced by make_fx. SmolLM2's LoRA step at
256 tokens: 12,024 nodes recorded in 4.0-5.4 s against 11.2-12.7 with make_fx (interleaved, a loaded machine).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager, unset_fake_temporarily
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.experimental.proxy_tensor import (
    CONSTANT_NUMEL_LIMIT,
    disable_autocast_cache,
    extract_val,
)
from torch.fx.node import Argument
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    autograd_would_have_decomposed,
)
from torch.utils.weak import WeakIdKeyDictionary

from remat.core.capture import Unrecordable
from remat.core.graph import laid_out_on, new_node

aten = torch.ops.aten
_METADATA = (aten.size.default, aten.stride.default, aten.storage_offset.default)


def record(fn: Callable[..., tuple], args: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Run `fn(*args)` on fake tensors and keep what it computes as an fx graph (make_fx's; `Unrecordable`
    where it cannot be)."""
    recorder = _Recorder()
    for i, a in enumerate(args):
        node = recorder.graph.placeholder(f"arg{i}_1")  # make_fx's names
        node.meta["val"] = extract_val(a)
        recorder.track(a, node, None)
    with recorder, disable_autocast_cache():
        out = fn(*args)
    recorder.graph.output(recorder.arg(out))
    return _make_graph_module(recorder.root, recorder.graph, fn.__name__)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.root, self.graph = nn.Module(), fx.Graph()
        # Weakly: a factory's result held elsewhere is detached by autograd (a node make_fx never sees).
        self.node_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the node that made it
        self.constant_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its real value, where known
        self.attrs: dict[torch.Tensor, str] = {}  # untracked tensor -> its `_tensor_constant` name

    def last_node(self) -> fx.Node:  # asked by the tracer (`capture.trace`) for the forward's last node
        return next(reversed(self.graph.nodes))

    def track(self, t: torch.Tensor, node: fx.Node, constant: torch.Tensor | None) -> None:
        self.node_of[t] = node
        if constant is None:
            self.constant_of.pop(t, None)
        else:
            self.constant_of[t] = constant

    def arg(self, a: object) -> Argument:
        if isinstance(a, torch.Tensor):
            node = self.node_of.get(a)
            return node if node is not None else self._constant(a)
        if isinstance(a, (tuple, list)):
            if isinstance(a, tuple) and hasattr(a, "_fields"):
                raise Unrecordable(f"a named tuple argument ({type(a).__name__})")
            return type(a)(self.arg(x) for x in a) if type(a) in (tuple, list) else tuple(self.arg(x) for x in a)
        if isinstance(a, dict):
            return {k: self.arg(v) for k, v in a.items()}
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Unrecordable("symbolic sizes")
        return a  # type: ignore[return-value]  # a constant: a number, a dtype, a device...

    def _constant(self, t: torch.Tensor) -> fx.Node:
        """A tensor the step did not make: an attribute of the graph module, as make_fx keeps it."""
        if isinstance(t, nn.Parameter):
            name = _fresh(self.root, "_param_constant")
        else:
            name = self.attrs.get(t) or _fresh(self.root, "_tensor_constant")
            self.attrs[t] = name
        setattr(self.root, name, t)
        node = self.graph.create_node("get_attr", name)
        node.meta["val"] = extract_val(t)  # a real tensor's: a fake one laid out alike, as make_fx's
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:
            t = args[0]
            if isinstance(t, FakeTensor):
                return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
            return func(*args, **kwargs)
        if func is aten.sym_numel.default:  # make_fx decomposes it (a table of one)
            raise Unrecordable("sym_numel")
        tensors = _tensors((args, kwargs))
        if _decomposable(func) and autograd_would_have_decomposed(func, tensors):
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        if func is aten.is_nonzero.default:
            with self:
                return (args[0] != 0).item()
        tracked = [t for t in tensors if t in self.node_of]
        all_constant = all(t in self.constant_of for t in tracked)
        if torch.Tag.data_dependent_output in func.tags and all_constant:
            with unset_fake_temporarily():
                return func(*self._constants(args), **self._constants(kwargs))
        if func is aten.lift_fresh.default:
            func = aten.lift_fresh_copy.default
        node = new_node(self.graph, "call_function", func, self.arg(args), self.arg(kwargs),
                        name=self.graph._target_to_str(func.overloadpacket.__name__))
        out = _viewed(func, args, kwargs, tensors) if func.is_view else func(*args, **kwargs)
        constant = None
        if func is aten.lift_fresh_copy.default and out.numel() <= CONSTANT_NUMEL_LIMIT:
            with unset_fake_temporarily():
                constant = args[0].clone()
        elif (torch.Tag.nondeterministic_seeded not in func.tags and all_constant
              and any(t in self.constant_of for t in tracked)
              and all(t.numel() <= CONSTANT_NUMEL_LIMIT for t in _tensors(out))):
            with unset_fake_temporarily():
                constant = func(*self._constants(args), **self._constants(kwargs))
        self._track_out(out, node, constant)
        return out

    def _constants(self, a: object) -> object:
        if isinstance(a, torch.Tensor):
            return self.constant_of.get(a, a)
        if isinstance(a, (tuple, list)):
            return type(a)(self._constants(x) for x in a)
        if isinstance(a, dict):
            return {k: self._constants(v) for k, v in a.items()}
        return a

    def _track_out(self, out: object, node: fx.Node, constant: object) -> None:
        if isinstance(out, torch.Tensor):
            self.track(out, node, constant)  # type: ignore[arg-type]
            node.meta["val"] = _snapshot(out)
        elif isinstance(out, (tuple, list)):
            node.meta["val"] = type(out)(map(_snapshot, out))
            for i, e in enumerate(out):
                item = new_node(self.graph, "call_function", operator.getitem, (node, i))
                self._track_out(e, item, constant[i] if constant is not None else None)  # type: ignore[index]
        elif isinstance(out, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Unrecordable("symbolic sizes")
        elif out is not None and not isinstance(out, (int, float, bool)):
            raise Unrecordable(f"a {type(out).__name__} result of {node.target}")


def _viewed(func, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> object:
    """`func(*args, **kwargs)` for a view op: of one fake tensor, the view made on its meta tensor directly and
    wrapped as the mode would (a view's layout is fixed by its arguments: no fake kernel to choose one). Through
    the mode's dispatch and its cache, a view cost 190 µs against 52; views are half a step's ops."""
    if len(tensors) != 1 or not isinstance(t := tensors[0], FakeTensor) or t.constant is not None:
        return func(*args, **kwargs)
    with in_kernel_invocation_manager(t.fake_mode):
        out = func(*args, **kwargs)
    return FakeTensor(t.fake_mode, out, t.fake_device) if isinstance(out, torch.Tensor) else type(out)(
        FakeTensor(t.fake_mode, e, t.fake_device) for e in out)


def _snapshot(value: object) -> object:
    """The value as it is now, as a plan reads it: its layout on its storage (`laid_out_on`). make_fx keeps a
    detached fake copy, the same layout and storage at five times the cost (a tenth of recording a step)."""
    if not isinstance(value, FakeTensor):
        return extract_val(value)  # type: ignore[arg-type]  # a number, None: as it is
    with unset_fake_temporarily():  # a plain meta tensor, not a fake one made by the mode below
        return laid_out_on(value, value.untyped_storage(), value.storage_offset())


@functools.cache
def _decomposable(func) -> bool:
    """Has a CompositeImplicitAutograd kernel (which make_fx runs where autograd would have)."""
    return func not in _METADATA and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (tuples, lists and dicts of them), in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [t for e in tree for t in _tensors(e)] if isinstance(tree, (tuple, list)) else []


def _fresh(root: nn.Module, prefix: str) -> str:
    i = 0
    while hasattr(root, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"
