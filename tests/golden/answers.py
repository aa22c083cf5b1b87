"""The answers `golden.json` holds (see cases.py), worked out by the code of today. Every case computes in float32
(`--dtype float32`): golden.json was written before the compute dtype was a setting, and `auto` resolves per CPU."""

from __future__ import annotations

import cases
import torch

from planning import planner_of
from remat.base.settings import GateRefused, TrainSettings
from remat.training import gate
from remat.training.step import StepShape
from remat.training.train import finetune


def settings(fields: dict) -> TrainSettings:
    return TrainSettings(**{"dtype": "float32", **fields})


def plans() -> dict:
    out = {}
    for name, fields, which in cases.PLANS:
        s = settings(fields)
        out[name] = {k: p.as_dict() for k, p in planner_of(s).plans(StepShape.of(s), which).items()}
    return out


def world() -> dict:
    out = {}
    for name, fields, world_size, policy in cases.WORLD:
        admitted = gate.admit(settings({**fields, "recompute": policy}), gate.Budget.unlimited(),
                              world_size=world_size)
        out[name] = admitted.plan.as_dict()
    return out


def choices() -> dict:
    out = {}
    for name, fields, budget in cases.CHOICES:
        try:
            admitted = gate.admit(settings(fields), gate.Budget(budget, "--memory-budget"))
        except GateRefused as e:
            out[name] = {"refused": str(e), "plans": e.plans}
            continue
        out[name] = {"policy": admitted.policy, "reason": admitted.choice.reason,
                     "plans": {k: p.as_dict() for k, p in admitted.plans.items()}}
    return out


def train(runs: list[tuple[str, dict]]) -> dict:
    """Each run's losses, policy and plans (less the measured runtime and trace, and the total they are in)."""
    torch.set_num_threads(1)
    out = {}
    for name, fields in runs:
        r = finetune(settings(fields), progress=False).as_dict()
        out[name] = {"losses": r["losses"], "policy": r["policy"],
                     "plans": {k: {c: v for c, v in p.items() if c not in ("runtime", "trace", "total")}
                               for k, p in r["plans"].items()}}
    return out
