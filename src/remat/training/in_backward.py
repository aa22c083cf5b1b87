"""The optimizer in the backward (torchtune's "optimizer in backward"): each parameter's AdamW update applied the
moment its gradient is complete, inside the step, so the gradients never all exist at once.

The traced step stays as it is (it returns the loss and the grads, as the planner and every other path read it);
what runs is a copy of its graph with an update node after each gradient's last writer and the parameter's last
reader (`core.updates.update_points`, the planner's own rule) and the loss alone as its output, so the generated
code frees each gradient right after its update. The update is the optimizer's own `step` with that one
parameter's `.grad` set: torch's AdamW on CPU runs its single-tensor loop, one parameter at a time, either way, so
each tensor gets the same ops in the same order as stepping after the backward, and the losses are bitwise
the same. The optimizer is one AdamW over every parameter, so its state and checkpoints are the usual ones.

It does not apply where gradients must be summed or averaged before any update: several windows per step
(`--accumulate`), the walk, several ranks (`gate.not_in_backward`).
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.optim.optimizer import _get_scalar_dtype

from remat.core.graph import TrainGraph
from remat.core.plan import held_inside, sized_storages
from remat.core.updates import update_points

UPDATE = "remat_update"  # the submodule the update nodes call


class Update(nn.Module):
    """The update nodes' target: `update(k, grad)` steps the optimizer on trainable k with `grad` as its gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]):
        super().__init__()
        self.optimizer, self.params = optimizer, params

    def forward(self, k: int, grad: torch.Tensor) -> None:
        p = self.params[k]
        p.grad = grad
        try:  # what the update holds inside, while someone measures (`plan.measure`): its temporaries
            held_inside(self.optimizer.step, [p, grad, *self.optimizer.state[p].values()])
        finally:
            p.grad = None


def ready_state(optimizer: torch.optim.Optimizer) -> None:
    """Make AdamW's state of every parameter now, as its first step would (zeros): the plan holds it from the start,
    and an update inside a measured step must not count it as its own (`Update`)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                state = optimizer.state[p]
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def updating(tg: TrainGraph, update: Update) -> TrainGraph:
    """`tg` run with the optimizer in its backward: a copy whose graph updates each trainable where the planner
    says (`update_points`) and returns the loss alone."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(tg.graph.nodes)
    output = nodes[-1]
    loss, *grads = output.args[0]
    pos = {n: i for i, n in enumerate(nodes)}
    before = [max([i] + [pos[u] for u in n.users if u.op != "output"]) for i, n in enumerate(nodes)]
    params = [pos[n] for n, r in zip(tg.placeholders(), tg.roles) if r == "trainable"]
    points = update_points([sized_storages(n) for n in nodes], before, [pos[g] for g in grads], params)
    after: dict[int, list[int]] = {}
    for k, at in enumerate(points):
        after.setdefault(at, []).append(k)
    for i, n in enumerate(nodes[:-1]):
        env[n] = graph.node_copy(n, env.__getitem__)
        for k in after.get(i, ()):
            graph.call_module(UPDATE, (k, env[grads[k]]))
    graph.output((env[loss],))
    owned = {n.target: getattr(tg.gm, n.target) for n in nodes if n.op in ("get_attr", "call_module")}
    gm = _LazyGraphModule({**owned, UPDATE: update}, graph)  # the traced module is left as it is
    return TrainGraph(gm=gm, roles=tg.roles, names=tg.names, boundary=env[tg.boundary],
                      info={**tg.info, "updates": True}, workspaces=tg.workspaces)
