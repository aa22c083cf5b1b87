"""Optimizer in the backward (torchtune's "optimizer in backward"): where, in a step's node order, each trainable
tensor's update can run, so that its gradient is given back at once and the gradients never all exist together.

An update can run once its gradient is complete and the parameter is read no more: after the last node that
touches the gradient's storage (its maker, the in-place sums into it) or the parameter's (a view of the weight
that a later backward op reads: the update writes the parameter in place), the step's output aside. One rule for
the planner's node orders (a made graph, and rewrites and stamps planned without a graph: `plan`) and for the
graph that runs (`training.in_backward`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

# torch's single-tensor AdamW (what `torch.optim.AdamW` runs on CPU, a parameter at a time) makes two temporaries
# of the parameter it updates, `sqrt` and the quotient of the denominator, both alive at once (the rest runs in
# place): measured by the tracker `plan.measure` uses (`plan.held_inside`), and held by the plan at each update.
ADAMW_TEMPORARIES = 2


def update_points(held: Sequence[Sequence[tuple[Hashable, int]]], last_read: Sequence[int],
                  grads: Sequence[int], params: Sequence[int]) -> list[int]:
    """The position after which each trainable's update runs: the last that touches its gradient's storages or
    its parameter's. `held[i]`: the storages node i holds (with bytes); `last_read[i]`: the position of its last
    reader, the step's output aside (or i); `grads[k]`, `params[k]`: the positions of trainable k's gradient (an
    output of the step) and of its placeholder."""
    touched: dict[Hashable, int] = {}
    for i, storages in enumerate(held):
        for s, _ in storages:
            touched[s] = max(touched.get(s, i), last_read[i])
    return [max(touched[s] for s, _ in (*held[g], *held[p])) for g, p in zip(grads, params, strict=True)]
