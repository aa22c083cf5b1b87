"""remat: fine-tune language models in less memory: the whole training step as one graph, one checkpoint per
layer, everything else recomputed (bitwise the same losses and gradients), memory planned before anything is
allocated.

The Python API, for a training loop of your own (README, "Python API"):

- `load_model(spec)`: a GGUF file, a safetensors folder or a preset, as a transformers model and tokenizer, its
  frozen weights as the file stores them (a GGUF's blocks; `as_stored=False`: float32, for full fine-tuning); or
  bring any transformers causal LM.
- `TrainSettings`: a job's settings (the command line's and `POST /train`'s fields).
- `Budget`, `admit(settings, budget, planner=...)`: the gate, the same answer `remat plan` prints.
- `Planner(model)`: `build(shape, policy)` the traced, rewritten step (`StepShape.of(settings)`), `plans`,
  `choose`; each new batch shape is a new step, traced once and kept by the planner.
- `StepInputs.of(model).args(input_ids, labels)`: the step's arguments; it returns `(loss, grads)`.
- `prepare(model)` / `unprepare(model)`: what building a step changes on the model (forward hooks marking each
  decoder layer's output, remat's attention), put on and taken off.
- `finetune(settings)`: the whole trainer, as `remat finetune`.

Importing `remat` loads none of torch or transformers: each name is imported on first use.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# Nothing is ever fetched from a hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_WHERE = {
    "load_model": "remat.models.load",
    "TrainSettings": "remat.base.settings",
    "GateRefused": "remat.base.settings",
    "Budget": "remat.training.gate",
    "admit": "remat.training.gate",
    "Planner": "remat.training.step",
    "StepShape": "remat.training.step",
    "StepInputs": "remat.core.graph",
    "prepare": "remat.models.hf",
    "unprepare": "remat.models.hf",
    "finetune": "remat.training.train",
}
__all__ = ["Budget", "GateRefused", "Planner", "StepInputs", "StepShape", "TrainSettings", "admit", "finetune",
           "load_model", "prepare", "unprepare"]

if TYPE_CHECKING:
    from remat.base.settings import GateRefused, TrainSettings
    from remat.core.graph import StepInputs
    from remat.models.hf import prepare, unprepare
    from remat.models.load import load_model
    from remat.training.gate import Budget, admit
    from remat.training.step import Planner, StepShape
    from remat.training.train import finetune


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
