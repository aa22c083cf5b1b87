"""The step, built in one place: trace (and rewrite) the train step for a model and settings, once.

The trainer, `remat plan`, `remat verify`, the bench and the server's `/train` all get
their graph and its plans here, so a setting changes the graph the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from remat import adapters, models, walk
from remat.capture import EagerStridesFakeMode, capture
from remat.graph import TrainGraph
from remat.hf import LAYER_MARK
from remat.plan import Plan, plan
from remat.recompute import rewrite
from remat.settings import TrainSettings


@dataclass(frozen=True)
class StepShape:
    """What fixes the traced graph: the path, the batch and window (or chunk) shape, and the loss pieces."""

    path: str  # "window" or "walk"
    batch: int
    ctx: int
    ubatch: int | None  # walk: tokens per chunk
    loss_chunk: int

    @classmethod
    def of(cls, s: TrainSettings) -> StepShape:
        return cls(s.path, s.batch, s.ctx, s.ubatch if s.path == "walk" else None, s.loss_chunk)


def build(model: nn.Module, shape: StepShape, recompute: bool) -> TrainGraph:
    """The traced (and, with recompute, rewritten) step for this model and shape, traced once.

    The cache lives on the model: an epoch, every chunk of a walk, and the plans of both
    settings reuse one trace.
    """
    cache = model.__dict__.setdefault("_remat_graphs", {})
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    key = (shape, trainable, recompute)
    if key not in cache:
        if not recompute:
            cache[key] = _trace(model, shape)
        else:
            cache[key] = rewrite(build(model, shape, False), LAYER_MARK)
    return cache[key]


def _trace(model: nn.Module, shape: StepShape) -> TrainGraph:
    if shape.path == "walk":
        assert shape.ubatch is not None
        return walk.capture_chunk(model, shape.batch, shape.ctx, shape.ubatch, loss_chunk=shape.loss_chunk)
    ids = torch.zeros(shape.batch, shape.ctx, dtype=torch.long)
    return capture(model, ids, ids.clone(), loss_chunk=shape.loss_chunk)  # two tensors: two inputs


def plans(model: nn.Module, shape: StepShape, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """The memory plan of the step with recompute "off" and/or "on"."""
    return {k: plan(build(model, shape, k == "on")) for k in which}


def lora_settings(s: TrainSettings) -> adapters.LoraSettings | None:
    """The adapter the settings ask for; None for full fine-tuning."""
    return adapters.LoraSettings(s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_targets) if s.lora else None


def planning_model(config, s: TrainSettings) -> nn.Module:
    """The model as training would hold it, built on fake tensors: shapes and dtypes, no weights."""
    model: nn.Module
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = models.build_from_config(config, seed=s.seed)
    lora = lora_settings(s)
    if lora is not None:  # outside the fake mode: PEFT cannot swap fake weights, and the adapter is small
        model = adapters.apply_lora(model, lora, seed=s.seed)
    return model


def plan_settings(s: TrainSettings, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """Plans from the model's config alone: nothing of the model's size is allocated."""
    return plans(planning_model(models.load_config(s.model), s), StepShape.of(s), which)
