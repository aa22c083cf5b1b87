"""Write golden.json (see cases.py): run once with the code to hold later code to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cases
import torch

from remat import models, step
from remat.base.settings import GateRefused, TrainSettings
from remat.core.plan import per_rank
from remat.training.train import finetune


def main() -> None:
    torch.set_num_threads(1)
    out: dict = {"plans": {}, "world": {}, "choices": {}, "train": {}}
    for name, fields, which in cases.PLANS:
        s = TrainSettings(**fields)
        out["plans"][name] = {k: p.as_dict() for k, p in step.plan_settings(s, which).items()}
        print(name, flush=True)
    for name, fields, world, policy in cases.WORLD:
        s = TrainSettings(**fields)
        local = s.model_copy(update={"batch": s.batch // world})
        with per_rank(world):
            plans = step.plans(step.planning_model(models.load_config(s.model), s), step.StepShape.of(local), (policy,))
        out["world"][name] = plans[policy].as_dict()
    for name, fields, budget in cases.CHOICES:
        s = TrainSettings(**fields)
        model = step.planning_model(models.load_config(s.model), s)
        try:
            c = step.choose(model, step.StepShape.of(s), s.recompute, budget)
        except GateRefused as e:
            out["choices"][name] = {"refused": str(e), "plans": e.plans}
            continue
        out["choices"][name] = {"policy": c.policy, "reason": c.reason,
                                "plans": {k: p.as_dict() for k, p in c.plans.items()}}
        print(name, c.policy, flush=True)
    for name, fields in cases.TRAIN:
        r = finetune(TrainSettings(**fields), progress=False).as_dict()
        plans = {k: {c: v for c, v in p.items() if c not in ("runtime", "trace", "total")}
                 for k, p in r["plans"].items()}
        out["train"][name] = {"losses": r["losses"], "policy": r["policy"], "plans": plans}
        print(name, r["losses"], flush=True)
    Path(__file__).with_name("golden.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
# The demo's entry ("demo": losses, policy, plans less runtime and trace) is the receipt of `make demo`
# (`remat finetune --out out/demo --json`), added by hand from that run.
