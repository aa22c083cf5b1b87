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

from remat.base.files import staged
from remat.base.settings import UsageError

STATE = "trainer_state.json"
_NAME = re.compile(r"checkpoint-(\d+)")


class CheckpointError(UsageError):
    """No usable checkpoint where one was asked for; one line for the user."""


@dataclass
class Checkpoint:
    path: Path
    step: int


def save(out: Path, step: int, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
         losses: list[float], *, rng: torch.Tensor | None = None, world_size: int = 1,
         chosen: dict | None = None) -> Path:
    """`rng`: the RNG state (default this process's); a data-parallel run passes every rank's, stacked. `chosen`:
    the settings the run chose itself (its loss chunk), which a resumed run keeps (`chosen`)."""
    final = out / f"checkpoint-{step}"
    with staged(final, mode="replace") as tmp:
        save_file({k: v.detach().contiguous() for k, v in trainable.items()}, tmp / "trainable.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(torch.get_rng_state() if rng is None else rng, tmp / "rng.pt")
        state = ({"step": step, "losses": losses} | ({"world_size": world_size} if world_size > 1 else {})
                 | ({"chosen": chosen} if chosen else {}))
        (tmp / STATE).write_text(json.dumps(state))
    return final


def latest(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at `path`, or the latest complete `checkpoint-<step>` inside it."""
    root = Path(path)
    if (root / STATE).is_file() and (m := _NAME.fullmatch(root.name)):
        return Checkpoint(root, int(m[1]))
    try:  # no folder, or one removed while we look (a finished job's checkpoints are deleted)
        found = sorted((int(m[1]), p) for p in root.iterdir()
                       if (m := _NAME.fullmatch(p.name)) and (p / STATE).is_file())
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"--resume {root}: no such folder") from None
    if not found:
        raise CheckpointError(f"--resume {root}: no complete checkpoint-<step> folder in it")
    step, best = found[-1]
    return Checkpoint(best, step)


def chosen(ckpt: Checkpoint) -> dict:
    """The settings the run that wrote `ckpt` chose itself (its loss chunk): a resumed run keeps them."""
    return json.loads((ckpt.path / STATE).read_text()).get("chosen", {})


def restore(ckpt: Checkpoint, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, *,
            rank: int = 0, world_size: int = 1) -> list[float]:
    """Load a checkpoint into the model's trainable tensors and the optimizer; returns the losses so far.

    A checkpoint of a data-parallel run resumes with as many processes (each takes its own RNG state)."""
    state = json.loads((ckpt.path / STATE).read_text())
    if state.get("world_size", 1) != world_size:
        raise CheckpointError(f"--resume {ckpt.path}: written by a run of {state.get('world_size', 1)} "
                              f"process(es), resumed with {world_size}: resume it with the same number")
    tensors = load_file(ckpt.path / "trainable.safetensors")
    if tensors.keys() != trainable.keys():
        raise CheckpointError(f"--resume {ckpt.path}: its tensors do not match this model and settings")
    with torch.no_grad():
        for name, t in trainable.items():
            t.copy_(tensors[name])
    optimizer.load_state_dict(torch.load(ckpt.path / "optimizer.pt", weights_only=True))
    rng = torch.load(ckpt.path / "rng.pt", weights_only=True)
    # a row of its own: torch.set_rng_state reads from its storage's start (a row view at an offset crashes it)
    torch.set_rng_state(rng[rank].clone() if world_size > 1 else rng)
    return state["losses"]
