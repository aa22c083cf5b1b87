"""The trainer: data -> windows -> one traced step per batch shape -> AdamW -> receipt.

A reader sees the whole loop in `finetune`: load, plan and gate, then for each batch
run the (rewritten) graph, hand its grads to the optimizer, and record the loss.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from remat import data, models
from remat.capture import StepInputs, TrainGraph, capture
from remat.plan import Plan, available_memory, gate, measure, plan, preflight
from remat.recompute import rewrite

CHECKPOINT_PREFIX = "l_out"  # recompute "on" keeps exactly the per-layer residual stream
# With recompute, only one chunk's logits live at a time. SmolLM2 at ctx 2048 plans a
# 1,296 MiB graph unchunked, 545 MiB at 512 and 473 MiB at 256 (`remat plan --loss-chunk`).
DEFAULT_LOSS_CHUNK = 256


class UsageError(ValueError):
    """A setting that cannot work; the message is one line for the user."""


@dataclass
class Settings:
    model: str | None = None  # path or preset; None: the embedded default
    data: str | list | None = None  # path or in-memory records; None: the bundled corpus
    ctx: int = 256
    batch: int = 1
    epochs: int = 1
    steps: int | None = None  # cap on optimizer steps
    lr: float = 1e-4
    seed: int = 0
    recompute: str = "auto"  # "on" | "off" | "auto"
    loss_chunk: int = DEFAULT_LOSS_CHUNK  # tokens per piece of the loss head; 0: one piece
    memory_budget: int | None = None  # bytes; None: the device's free memory
    out: str | None = None

    def check(self) -> None:
        for name in ("ctx", "batch", "epochs"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be a positive integer, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise UsageError(f"--steps must be a positive integer, got {self.steps}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.loss_chunk < 0:
            raise UsageError(f"--loss-chunk must be 0 or more, got {self.loss_chunk}")
        if self.recompute not in ("on", "off", "auto"):
            raise UsageError(f"--recompute must be on, off or auto, got {self.recompute!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise UsageError("--memory-budget must be positive")


def step_graph(model: torch.nn.Module, shape: tuple[int, int], recompute: bool, loss_chunk: int) -> TrainGraph:
    """The traced (and, with recompute, rewritten) step for this model and options, traced once."""
    cache = model.__dict__.setdefault("_remat_graphs", {})
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    key = (shape, loss_chunk, trainable, recompute)
    if key not in cache:
        base = key[:-1] + (False,)
        if base not in cache:
            ids = torch.zeros(shape, dtype=torch.long)
            cache[base] = capture(model, ids, ids.clone(), loss_chunk=loss_chunk)  # two tensors: two inputs
        if recompute:
            cache[key] = rewrite(cache[base], CHECKPOINT_PREFIX)
    return cache[key]


def plans_for(model: torch.nn.Module, shape: tuple[int, int], loss_chunk: int) -> dict[str, Plan]:
    return {k: plan(step_graph(model, shape, k == "on", loss_chunk)) for k in ("off", "on")}


def finetune(s: Settings, *, progress: bool = True) -> dict:
    """Train as `s` says and return the receipt (shared/DESIGN.md §8)."""
    s.check()
    budget = s.memory_budget or available_memory()  # read before the model takes its share
    torch.manual_seed(s.seed)
    loaded = models.load_model(s.model, seed=s.seed)
    model = loaded.model
    if s.ctx > loaded.max_ctx:
        raise UsageError(f"--ctx {s.ctx} is above the model's maximum context {loaded.max_ctx}")
    windows = data.load_windows(s.data if s.data is not None else data.default_data_path(),
                                loaded.tokenizer, s.ctx, s.batch)

    shape = (s.batch, s.ctx)
    plans = plans_for(model, shape, s.loss_chunk)
    use_recompute, reason = gate(plans, budget, s.recompute)
    graph = step_graph(model, shape, use_recompute, s.loss_chunk)
    preflight(graph, next(model.parameters()).device)
    tensors = StepInputs.of(model)
    params = list(tensors.trainable.values())
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)

    per_epoch = len(windows) // s.batch
    total = min(s.steps or per_epoch * s.epochs, per_epoch * s.epochs)
    losses: list[float] = []
    epoch_seconds: list[float] = []
    measured = None
    bar = tqdm(total=total, desc="finetune", unit="step", file=sys.stderr, disable=not progress)
    start = time.perf_counter()
    for epoch in range(s.epochs):
        t0 = time.perf_counter()
        for input_ids, labels in data.batches(windows, s.batch, seed=s.seed, epoch=epoch):
            if len(losses) == total:
                break
            args = tensors.args(input_ids, labels)
            if measured is None:  # the first step runs observed: the receipt's measured peak
                (loss, *grads), measured = measure(graph, args)
            else:
                loss, grads = graph(*args)
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            tokens = len(losses) * s.batch * s.ctx
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
            bar.update()
        epoch_seconds.append(time.perf_counter() - t0)
        if len(losses) == total:
            break
    bar.close()
    elapsed = time.perf_counter() - start

    outputs = save_model(loaded, s.out) if s.out else []
    return {
        "model": loaded.name,
        "losses": losses,
        "recompute": use_recompute,
        "recompute_reason": reason,
        "plan": plans["on" if use_recompute else "off"].as_dict(),
        "plans": {k: p.as_dict() for k, p in plans.items()},
        "measured": measured.as_dict(),
        "steps": len(losses),
        "seconds_per_epoch": statistics.mean(epoch_seconds),
        "tokens_per_second": len(losses) * s.batch * s.ctx / elapsed,
        "settings": {**asdict(s), "data": s.data if isinstance(s.data, str) or s.data is None else "<records>",
                     "memory_budget": budget},
        "outputs": outputs,
    }


def save_model(loaded: models.LoadedModel, out: str) -> list[str]:
    """Write the model in HF layout (safetensors) into `out`, all or nothing."""
    dest = Path(out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        loaded.model.save_pretrained(tmp, safe_serialization=True)
        loaded.tokenizer.save_pretrained(tmp)
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(str(p) for p in dest.iterdir())
