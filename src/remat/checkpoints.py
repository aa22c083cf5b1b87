"""Checkpoints: everything a run needs to continue exactly, written all or nothing.

`checkpoint-<step>/` holds the trainable tensors (the adapter, or the full weights),
the optimizer state, the RNG state and the losses so far; the data position follows
from the step (batches are a function of seed and epoch). A checkpoint is written into
a temporary folder and renamed into place, so a run killed mid-save leaves the previous
checkpoint whole.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from remat.files import staged
from remat.settings import UsageError

STATE = "trainer_state.json"
_NAME = re.compile(r"checkpoint-(\d+)")


class CheckpointError(UsageError):
    """No usable checkpoint where one was asked for; one line for the user."""


@dataclass
class Checkpoint:
    path: Path
    step: int


def save(out: Path, step: int, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
         losses: list[float]) -> Path:
    final = out / f"checkpoint-{step}"
    with staged(final, mode="replace") as tmp:
        save_file({k: v.detach().contiguous() for k, v in trainable.items()}, tmp / "trainable.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(torch.get_rng_state(), tmp / "rng.pt")
        (tmp / STATE).write_text(json.dumps({"step": step, "losses": losses}))
    return final


def latest(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at `path`, or the latest complete `checkpoint-<step>` inside it."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"--resume {root}: no such folder")
    if (root / STATE).is_file() and (m := _NAME.fullmatch(root.name)):
        return Checkpoint(root, int(m[1]))
    found = sorted((int(m[1]), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name)) and (p / STATE).is_file())
    if not found:
        raise CheckpointError(f"--resume {root}: no complete checkpoint-<step> folder in it")
    step, best = found[-1]
    return Checkpoint(best, step)


def restore(ckpt: Checkpoint, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> list[float]:
    """Load a checkpoint into the model's trainable tensors and the optimizer; returns the losses so far."""
    tensors = load_file(ckpt.path / "trainable.safetensors")
    if tensors.keys() != trainable.keys():
        raise CheckpointError(f"--resume {ckpt.path}: its tensors do not match this model and settings")
    with torch.no_grad():
        for name, t in trainable.items():
            t.copy_(tensors[name])
    optimizer.load_state_dict(torch.load(ckpt.path / "optimizer.pt", weights_only=True))
    torch.set_rng_state(torch.load(ckpt.path / "rng.pt", weights_only=True))
    return json.loads((ckpt.path / STATE).read_text())["losses"]
