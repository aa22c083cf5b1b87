"""The planners tests plan with: what `remat plan` makes for a job (the model's config on fake weights, its LoRA
attached), through the gate's own `Planners`. And a second way to find a graph's peak (`live_at_peak`: a sweep
that keeps what is live), against the plan's one-pass `_peaks`."""

from __future__ import annotations

from collections.abc import Hashable, Set

import transformers
from torch import fx

from remat.base.settings import TrainSettings
from remat.core import plan as plan_module
from remat.core.graph import TrainGraph
from remat.core.plan import Lives, Plan
from remat.models.load import load_config
from remat.training import gate
from remat.training.step import Planner, StepShape


def planner_of(s: TrainSettings, config: transformers.PretrainedConfig | None = None) -> Planner:
    """The planner of the job `s` on its model's config (or `config`), fake weights."""
    return gate.Planners(config or load_config(s.model)).planner(s, gate.Budget.unlimited())


def plan_settings(s: TrainSettings, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """Plans from the model's config alone: nothing of the model's size is allocated."""
    return planner_of(s).plans(StepShape.of(s), which)


def live_at_peak(tg: TrainGraph, outputs: bool = False) -> tuple[int, fx.Node | None, list[tuple[fx.Node, int]]]:
    """The peak of graph-allocated bytes (with `outputs`, and the outputs made so far), the node where it is
    reached, and what is live then."""
    nodes, life, kept = plan_module._lifetimes(tg)
    peak, at, live = sweep(len(nodes), life, frozenset() if outputs else kept)
    return peak, None if at is None else nodes[at], [(nodes[maker], size) for maker, size in live]


def sweep(count: int, life: Lives, skip: Set) -> tuple[int, int | None, list[tuple[int, int]]]:
    """The peak of live bytes over `count` positions, where it is, and what is live then (maker, bytes)."""
    made_at: dict[int, list[Hashable]] = {}
    frees_at: dict[int, list[Hashable]] = {}
    for s, (maker, _, end) in life.items():
        if s not in skip:
            made_at.setdefault(maker, []).append(s)
            frees_at.setdefault(end, []).append(s)
    live: set[Hashable] = set()
    total = peak = 0
    peak_at, peak_set = None, set()
    for i in range(count):
        for s in made_at.get(i, ()):
            live.add(s)
            total += life[s][1]
        if total > peak:
            peak, peak_at, peak_set = total, i, set(live)
        for s in frees_at.get(i, ()):
            live.discard(s)
            total -= life[s][1]
    return peak, peak_at, sorted(((life[s][0], life[s][1]) for s in peak_set), key=lambda x: -x[1])
