"""The planners tests plan with: what `remat plan` makes for a job (the model's config on fake weights, its LoRA
attached), through the gate's own `Planners`."""

from __future__ import annotations

import transformers

from remat.base.settings import TrainSettings
from remat.core.plan import Plan
from remat.models.load import load_config
from remat.training import gate
from remat.training.step import Planner, StepShape


def planner_of(s: TrainSettings, config: transformers.PretrainedConfig | None = None) -> Planner:
    """The planner of the job `s` on its model's config (or `config`), fake weights."""
    return gate.Planners(config or load_config(s.model)).planner(s, gate.Budget.unlimited())


def plan_settings(s: TrainSettings, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """Plans from the model's config alone: nothing of the model's size is allocated."""
    return planner_of(s).plans(StepShape.of(s), which)
