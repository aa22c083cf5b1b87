"""What the benchmarks share: a variant (a model, its optimizer and its step) run and measured the same way for
all, random batches, and the figures' formats. `compare` (`remat bench`) and `sweep` (`remat bench --sweep`) build
on it."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from remat.base.settings import MiB, TrainSettings
from remat.core.graph import StepInputs
from remat.core.plan import plan
from remat.core.process import process_peak, reset_process_peak, resident, trim_heap
from remat.models.hf import causal_lm_loss
from remat.training.step import Planner, StepShape
from remat.training.train import BatchRunner, Hooks

T = TypeVar("T")


# ---------------------------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_during(fn: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """Run `fn()` and return its result and the peak of bytes allocated while it ran, above the start.

    CPU: the profiler's allocation and free events, summed in order. CUDA: the allocator's peak
    statistic minus what was allocated before. Tensors alive before the call count for nothing.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda e: e.start_ns())  # stable: events with one timestamp keep their recorded order
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return result, peak


# ---------------------------------------------------------------------------------------- variants


@dataclass
class Variant:
    name: str
    model: nn.Module
    step: Callable[[torch.Tensor, torch.Tensor], float]  # forward + backward; leaves grads in p.grad
    setup: Callable[[], None]  # before the first step, outside its measurement (remat: trace, plan)
    params: list[torch.Tensor]
    loss_note: str
    planned_graph: int | None = None
    planned_cache: int | None = None
    measured_graph: int | None = None
    measured_peak: int | None = None
    process_peaks: list[int] = field(default_factory=list)  # per timed step: peak RSS above the step's start
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None

    def result(self) -> dict:
        timed = self.seconds[1:]  # the first step is the warm-up
        return {
            "variant": self.name,
            "trainable_parameters": sum(p.numel() for p in self.params),
            "planned_graph": self.planned_graph,
            "planned_cache": self.planned_cache,
            "measured_peak": self.measured_peak,
            "measured_graph": self.measured_graph,
            "process_peak": max(self.process_peaks, default=None),
            "step_seconds": statistics.median(timed) if timed else None,
            "step_seconds_all": self.seconds,
            "losses": self.losses,
            "loss": self.loss_note,
        }


def remat_variant(name: str, model: nn.Module, s: TrainSettings, recompute: str | bool,
                  planner: Planner | None = None) -> Variant:
    """remat's step under a policy (a name, or one `planner.choose` made), run as the trainer runs it."""
    params = list(StepInputs.of(model).trainable.values())
    state: dict = {}

    def setup() -> None:
        state["graph"] = (planner or Planner(model)).build(StepShape.of(s), recompute)
        p = plan(state["graph"])
        v.planned_graph, v.planned_cache = p.graph, (p.cache or None)

    def train_step(input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        if "runner" not in state:  # the walk's cache is allocated here, inside the measured step
            state["runner"] = BatchRunner(model, state["graph"], s, Hooks())
        runner: BatchRunner = state["runner"]
        # The graph holds its own backward: autograd must not record it (with grad mode on, every op
        # would save its inputs for a second, unused backward, and the grads would hold that graph).
        with torch.no_grad():
            loss, grads = runner.run(input_ids, labels)  # the first chunk runs observed (plan.measure)
        if v.measured_graph is None and runner.measured is not None:
            v.measured_graph = runner.measured.graph
        for p_, g in zip(params, grads):
            p_.grad = g
        return loss

    note = f"remat, loss in chunks of {s.loss_chunk}" if s.loss_chunk else "remat, unchunked loss"
    if s.path == "walk":
        note += f", {s.walk} walk in chunks of {s.ubatch}"
    v = Variant(name, model, train_step, setup, params, note)
    return v


def eager_variant(name: str, model: nn.Module, checkpoint: bool) -> Variant:
    if checkpoint:
        kwargs = {"use_reentrant": False}
        hf_model: Any = model
        if hasattr(model, "activation_checkpointing_enable"):  # transformers' newer name
            hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    params = list(StepInputs.of(model).trainable.values())

    def train_step(input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = causal_lm_loss(model, input_ids, labels, 0)  # what HF users get: one unchunked cross-entropy
        loss.backward()
        return loss.item()

    note = "HF eager, unchunked loss" + (", per-layer torch.utils.checkpoint" if checkpoint else "")
    return Variant(name, model, train_step, lambda: None, params, note)


def run_step(v: Variant, input_ids: torch.Tensor, labels: torch.Tensor, device: torch.device, *,
             warm_up: bool) -> None:
    """One training step of `v`, its optimizer update included; appends its time and loss.

    The warm-up (`warm_up`, a variant's first step): remat traces here; its forward and backward are measured
    (`peak_during`), not timed. Later steps are timed, and their process peak (optimizer update included) above
    their start, taken from a trimmed heap (`trim_heap`, left out of the time), is appended to `v.process_peaks`."""
    assert v.optimizer is not None
    optimizer = v.optimizer

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)

    if warm_up:
        t0 = time.perf_counter()
        v.setup()
        loss, v.measured_peak = peak_during(functools.partial(v.step, input_ids, labels), device)
        update()
    else:
        trim_heap()  # the start is what is live, not what the step before freed; outside the time
        before = resident()
        reset_process_peak()
        t0 = time.perf_counter()
        loss = v.step(input_ids, labels)
        update()
        if "rss" in (peak := process_peak()):
            v.process_peaks.append(peak["rss"] - before)
    v.seconds.append(time.perf_counter() - t0)
    v.losses.append(loss)


def random_batches(vocab: int, batch: int, ctx: int, steps: int,
                   seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of uniformly random tokens; labels are the next token (the last one is not trained)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, ctx + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


# ---------------------------------------------------------------------------------------- the bench


def mib(n: int | None) -> str:
    return "–" if n is None else f"{n / MiB:,.1f}"


def x(r: float | None) -> str:
    return "–" if r is None else f"{r:.3f}×"


def secs(t: float | None) -> str:
    return "–" if t is None else f"{t:.3f}"


def training(result: dict) -> str:
    """"LoRA r8" or "full" (results from before `--lora` were full fine-tuning)."""
    return f"LoRA r{result['lora']}" if result.get("lora") else "full"
