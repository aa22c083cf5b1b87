"""Offload: a device's checkpoints kept in pinned host memory between the forward and the backward.

The `offload` policy (`remat.core.policies`) saves what `on` saves, one `l_out` mark per layer, and says the marks
may leave the device. `apply`, a graph pass run after the rewrite, makes that so:
- after each offloaded mark `m`, `h = remat::offload(m)` copies it into pinned host memory on a side stream (the
  device's copy then dies after its last forward reader, as it would under `on` with nothing reading it later);
- ahead of the backward that needs it, one mark early, `d = remat::reload(h, device)` copies it back on the side
  stream; `remat::ready(d)`, just before its first backward reader, makes the step's stream wait for that copy.
  The backward reads `d` where it read `m`. The marks go back in the order the backward needs them: the copy of
  mark i overlaps the backward of the layer above.
The values are the same bytes, so losses and grads are bitwise those of `on`. The plan counts the host copies in
`offload` (all of them, alive together at the forward's end: `Plan.host`) and not in `graph` (`plan.HOST`); the
reloaded copies are graph values like any other. The CPU has no memory of its own to spare: there `offload` is
`on`, and this pass is not run (`applies`).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils.weak import WeakIdKeyDictionary

from remat.core import devices
from remat.core.graph import TrainGraph, laid_out_on, new_node
from remat.core.plan import HOST
from remat.core.policies import Policy

_side: dict[torch.device, torch.cuda.Stream] = {}  # the copies' stream, one per device
_done: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a reloaded tensor -> the event its copy records


def _stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side:
        _side[device] = torch.cuda.Stream(device)
    return _side[device]


@torch.library.custom_op("remat::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    """`x` copied into pinned host memory, on the side stream once the step's stream has made it."""
    if x.device.type != "cuda":  # not made by `apply` off CUDA; a copy, as a custom op returns no alias
        return x.clone()
    side = _stream(x.device)
    host = torch.empty_like(x, device="cpu", pin_memory=True)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
    x.record_stream(side)  # the device's copy is not handed out again before the side stream has read it
    return host


@offload.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, device="cpu")


@torch.library.custom_op("remat::reload", mutates_args=())
def reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` copied back to `device`, on the side stream after what the step's stream queued so far (the memory
    it is given may still be read there); `ready` waits for it."""
    if device.type != "cuda":
        return host.to(device, copy=True)
    out = torch.empty_like(host, device=device)
    side = _stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        out.copy_(host, non_blocking=True)  # the pinned block is held until the copy is done (torch records it)
    _done[out] = side.record_event()
    return out


@reload.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(host, device=device)


@torch.library.custom_op("remat::ready", mutates_args=("x",))
def ready(x: torch.Tensor) -> None:
    """The step's stream waits for `x`'s copy back (`reload`). Declared as writing `x`: it orders what reads it."""
    event = _done.pop(x, None)
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)


@ready.register_fake
def _(x: torch.Tensor) -> None:
    return None


OFFLOAD, RELOAD, READY = torch.ops.remat.offload.default, torch.ops.remat.reload.default, torch.ops.remat.ready.default


def applies(policy: Policy | None, device: torch.device) -> bool:
    """Whether a step of `policy` on `device` offloads (on the CPU, offload is `on`)."""
    return policy is not None and policy.offloads is not None and not devices.is_host(device)


def apply(tg: TrainGraph, policy: Policy, device: torch.device) -> TrainGraph:
    """The rewritten step `tg` with the checkpoints `policy.offloads` names kept in host memory between the
    forward and the backward (the module's docstring). A new graph; `tg` is left as it was."""
    assert policy.offloads is not None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(tg.graph, env))  # env: each node -> its copy
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = pos[env[tg.boundary]]
    later = [n for n in nodes[:end + 1] if n.op == "call_function" and policy.offloads(n)
             and any(pos[u] > end for u in n.users)]
    first = {m: min(pos[u] for u in m.users if pos[u] > end) for m in later}
    order = sorted(later, key=first.__getitem__)  # as the backward needs them
    for i, m in enumerate(order):
        with graph.inserting_after(m):
            h = new_node(graph, "call_function", OFFLOAD, (m,))
        h.meta.update(val=_new_storage(m.meta["val"]), **{HOST: True})
        ahead = nodes[end] if i == 0 else nodes[first[order[i - 1]]]  # one mark early
        with graph.inserting_before(ahead.next if i == 0 else ahead):
            d = new_node(graph, "call_function", RELOAD, (h, device))
        d.meta["val"] = _new_storage(m.meta["val"])
        with graph.inserting_before(nodes[first[m]]):
            new_node(graph, "call_function", READY, (d,)).meta["val"] = None
        for u in [u for u in m.users if u in pos and pos[u] > end]:
            u.replace_input_with(m, d)
    graph.lint()
    return TrainGraph(gm=_LazyGraphModule(tg.gm, graph), roles=tg.roles, names=tg.names, boundary=env[tg.boundary],
                      info={**tg.info, "offloaded": len(order)}, workspaces=tg.workspaces)


def _new_storage(t: torch.Tensor) -> torch.Tensor:
    """A value laid out as `t` on a storage of its own (meta: a plan reads layouts and storages alone)."""
    return laid_out_on(t, torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device="meta")
                       .untyped_storage(), t.storage_offset())
