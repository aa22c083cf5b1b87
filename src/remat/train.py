"""The trainer: data -> windows -> one traced step per batch shape -> AdamW -> receipt.

A reader sees the whole loop in `finetune`: load, plan and gate, then for each batch
run the (rewritten) graph, hand its grads to the optimizer, and record the loss.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from remat import adapters, checkpoints, data, models, walk
from remat.capture import DEFAULT_LOSS_CHUNK, StepInputs, TrainGraph, capture
from remat.plan import GateRefused, Measured, Plan, available_memory, gate, measure, plan, preflight
from remat.recompute import rewrite

CHECKPOINT_PREFIX = "l_out"  # recompute "on" keeps exactly the per-layer residual stream


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
    lr: float | None = None  # None: 1e-3 for LoRA, 1e-4 for full fine-tuning
    seed: int = 0
    recompute: str = "auto"  # "on" | "off" | "auto"
    loss_chunk: int = DEFAULT_LOSS_CHUNK  # tokens per piece of the loss head; 0: one piece
    path: str = "ubatch"  # "ubatch": one graph per window; "walk": chunks of `ubatch` tokens over a cache
    ubatch: int = 256  # walk: tokens per chunk
    accumulate: int = 1  # windows (batches) per optimizer step
    pack: bool = False  # True: documents concatenated into windows; False: one document per window, padded
    memory_budget: int | None = None  # bytes; None: the device's free memory
    out: str | None = None
    lora: bool = True  # False: full fine-tuning
    lora_r: int = 8
    lora_alpha: float = 16
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None  # None: every linear layer of the decoder
    save_every: int | None = None  # optimizer steps between checkpoints (into --out)
    resume: str | None = None  # a checkpoint folder, or a folder holding checkpoint-<step>/ folders

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.lora else 1e-4)

    def check(self) -> None:
        for name in ("ctx", "batch", "epochs", "ubatch", "accumulate"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be a positive integer, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise UsageError(f"--steps must be a positive integer, got {self.steps}")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.save_every is not None and (self.save_every < 1 or not self.out):
            raise UsageError("--save-every needs a positive number of steps and --out")
        if self.loss_chunk < 0:
            raise UsageError(f"--loss-chunk must be 0 or more, got {self.loss_chunk}")
        if self.recompute not in ("on", "off", "auto"):
            raise UsageError(f"--recompute must be on, off or auto, got {self.recompute!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise UsageError("--memory-budget must be positive")
        if self.path not in ("ubatch", "walk"):
            raise UsageError(f"--path must be ubatch or walk, got {self.path!r}")
        if self.path == "walk" and self.ctx % self.ubatch:
            raise UsageError(f"--ctx {self.ctx} must be a multiple of --ubatch {self.ubatch} on the walk path")


def step_graph(model: torch.nn.Module, s: Settings, recompute: bool) -> TrainGraph:
    """The traced (and, with recompute, rewritten) step for this model and settings, traced once.

    The cache lives on the model: an epoch, and every chunk of a walk, reuse one graph.
    """
    cache = model.__dict__.setdefault("_remat_graphs", {})
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    key = (s.path, s.batch, s.ctx, s.ubatch if s.path == "walk" else None, s.loss_chunk, trainable, recompute)
    if key not in cache:
        base = key[:-1] + (False,)
        if base not in cache:
            if s.path == "walk":
                cache[base] = walk.capture_chunk(model, s.batch, s.ctx, s.ubatch, loss_chunk=s.loss_chunk)
            else:
                ids = torch.zeros(s.batch, s.ctx, dtype=torch.long)
                cache[base] = capture(model, ids, ids.clone(), loss_chunk=s.loss_chunk)  # two tensors: two inputs
        if recompute:
            cache[key] = rewrite(cache[base], CHECKPOINT_PREFIX)
    return cache[key]


def plans_for(model: torch.nn.Module, s: Settings, which: list[str] = ("off", "on")) -> dict[str, Plan]:
    return {k: plan(step_graph(model, s, k == "on")) for k in which}


class Cancelled(Exception):
    """Raised by a `before_chunk` hook to stop training at a chunk boundary."""


@dataclass
class Hooks:
    """Calls a caller (the server) gets: before each chunk (it may wait, or raise Cancelled), after each step."""

    before_chunk: Callable[[], None] = lambda: None
    on_step: Callable[[dict], None] = lambda event: None


class Window:
    """Runs one batch of windows through the step graph: one chunk (ubatch) or ctx/ubatch chunks (walk)."""

    def __init__(self, model: torch.nn.Module, graph: TrainGraph, s: Settings, hooks: Hooks):
        self.graph, self.s, self.hooks = graph, s, hooks
        self.tensors = StepInputs.of(model)
        self.state = walk.new_state(model, s.batch, s.ctx) if s.path == "walk" else {}
        self.measured: Measured | None = None
        self.chunk_seconds: list[float] = []

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        s = self.s
        if s.path == "ubatch":
            return self._chunk([input_ids, labels])
        for t in self.state.values():
            t.zero_()  # a new window: no recurrent state carried in from the last one
        n_targets = (labels != -100).sum().to(torch.float32)
        loss, grads = 0.0, None
        for start in range(0, s.ctx, s.ubatch):
            piece = [t[:, start:start + s.ubatch].contiguous() for t in (input_ids, labels)]
            chunk_loss, chunk_grads = self._chunk([*self.state.values(), torch.tensor(start), n_targets, *piece])
            loss += chunk_loss
            grads = chunk_grads if grads is None else [a.add_(b) for a, b in zip(grads, chunk_grads)]
        return loss, grads

    def _chunk(self, inputs: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        self.hooks.before_chunk()
        t0 = time.perf_counter()
        args = self.tensors.args(*inputs)
        if self.measured is None:  # the first chunk runs observed: the receipt's measured peak
            (loss, *grads), self.measured = measure(self.graph, args)
        else:
            loss, grads = self.graph(*args)
        self.chunk_seconds.append(time.perf_counter() - t0)
        return loss.item(), grads


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def finetune(s: Settings, *, progress: bool = True, hooks: Hooks | None = None) -> dict:
    """Train as `s` says and return the receipt (shared/DESIGN.md §8)."""
    s.check()
    hooks = hooks or Hooks()
    budget = s.memory_budget or available_memory()  # read before the model takes its share
    out = Path(s.out) if s.out else None
    if out and out.exists() and (not out.is_dir() or any(out.iterdir())) and not s.resume:
        raise UsageError(f"--out {out} exists and is not an empty folder")
    resume = checkpoints.latest(s.resume) if s.resume else None
    torch.manual_seed(s.seed)
    loaded = models.load_model(s.model)  # a preset's weights are fixed: the seed is the run's, not the base's
    if s.ctx > loaded.max_ctx:
        raise UsageError(f"--ctx {s.ctx} is above the model's maximum context {loaded.max_ctx}")
    windows = data.load_windows(s.data if s.data is not None else data.default_data_path(),
                                loaded.tokenizer, s.ctx, s.batch, pack=s.pack)
    model = loaded.model
    if s.lora:
        model = adapters.apply_lora(model, adapters.LoraSettings(s.lora_r, s.lora_alpha, s.lora_dropout,
                                                                 s.lora_targets), seed=s.seed)

    plans = plans_for(model, s, ["off", "on"] if s.recompute == "auto" else [s.recompute])
    try:
        use_recompute, reason = gate(plans, budget, s.recompute)
    except GateRefused:
        gate(plans_for(model, s), budget, s.recompute)  # raises again, with both plans in the message
        raise
    graph = step_graph(model, s, use_recompute)
    preflight(graph, next(model.parameters()).device)
    tensors = StepInputs.of(model)
    params = list(tensors.trainable.values())
    optimizer = torch.optim.AdamW(params, lr=s.learning_rate, weight_decay=0.0)
    window = Window(model, graph, s, hooks)

    per_epoch = len(windows) // s.batch // s.accumulate
    total = min(s.steps or per_epoch * s.epochs, per_epoch * s.epochs)
    if total == 0:
        raise UsageError(f"--accumulate {s.accumulate} needs more batches than the data gives per epoch "
                         f"({len(windows) // s.batch})")
    losses: list[float] = []
    if resume:
        losses = checkpoints.restore(resume, tensors.trainable, optimizer)
    bar = tqdm(total=total, initial=len(losses), desc="finetune", unit="step", file=sys.stderr,
               disable=not progress)
    start = time.perf_counter()
    batches, epoch_of_batches, saved = [], -1, []
    for step in range(len(losses), total):
        epoch, i = divmod(step, per_epoch)
        if epoch != epoch_of_batches:
            batches, epoch_of_batches = data.batches(windows, s.batch, seed=s.seed, epoch=epoch), epoch
        step_loss, grads = 0.0, None
        for input_ids, labels in batches[i * s.accumulate:(i + 1) * s.accumulate]:
            loss, g = window.run(input_ids, labels)
            step_loss += loss / s.accumulate
            grads = g if grads is None else [a.add_(b) for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g.div_(s.accumulate) if s.accumulate > 1 else g
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        tokens = (len(losses) - (resume.step if resume else 0)) * s.accumulate * s.batch * s.ctx
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
        bar.update()
        hooks.on_step({"epoch": epoch, "step": len(losses), "loss": step_loss, "steps": total})
        if s.save_every and len(losses) % s.save_every == 0:
            saved.append(str(checkpoints.save(out, len(losses), tensors.trainable, optimizer, losses)))
    bar.close()
    elapsed = time.perf_counter() - start
    trained = len(losses) - (resume.step if resume else 0)

    outputs = save_outputs(model, loaded, s, out) if out else []
    chunks = window.chunk_seconds
    n_frozen = sum(t.numel() for t in tensors.frozen.values())
    return {
        "model": loaded.name,
        "losses": losses,
        "recompute": use_recompute,
        "recompute_reason": reason,
        "plan": plans["on" if use_recompute else "off"].as_dict(),
        "plans": {k: p.as_dict() for k, p in plans.items()},  # the ones the gate needed
        "measured": window.measured.as_dict() if window.measured else None,
        "steps": len(losses),
        "trainable_parameters": sum(p.numel() for p in params),
        "frozen_parameters": n_frozen,
        "seconds_per_epoch": elapsed / max(trained, 1) * per_epoch,
        "tokens_per_second": trained * s.accumulate * s.batch * s.ctx / elapsed,
        "chunks": len(chunks),
        "chunk_seconds": chunks,
        "window_p50": percentile(chunks, 0.5) if chunks else None,
        "window_p95": percentile(chunks, 0.95) if chunks else None,
        "resumed_from": str(resume.path) if resume else None,
        "checkpoints": saved,
        "settings": {**asdict(s), "lr": s.learning_rate, "memory_budget": budget,
                     "data": s.data if isinstance(s.data, str) or s.data is None else "<records>"},
        "outputs": outputs,
    }


def save_outputs(model: torch.nn.Module, loaded: models.LoadedModel, s: Settings, out: Path) -> list[str]:
    """The trained adapter (PEFT + GGUF) or full model (HF layout) into `out`, each file moved in whole."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".final-", dir=out))
    try:
        staging = tmp / "files"
        if s.lora:
            gguf = models.default_gguf_path() if s.model is None else (
                Path(s.model) if str(s.model).endswith(".gguf") else None)
            adapters.save_adapter(model, staging, base_name=s.model or adapters.DEFAULT_BASE, base_gguf=gguf)
        else:
            staging.mkdir()
            loaded.model.save_pretrained(staging, safe_serialization=True)
            loaded.tokenizer.save_pretrained(staging)
        files = []
        for f in sorted(staging.iterdir()):
            os.replace(f, out / f.name)
            files.append(str(out / f.name))
        return files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
