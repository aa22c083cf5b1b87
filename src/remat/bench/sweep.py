"""`remat bench --sweep`: a Pareto sweep, memory (planned and measured) against step time.

Compared on one model and one window shape (the window path), side by side in one process:

- remat's named recompute policies `off`, `dots`, `layer` (= `on`), `every:2`, `every:4` (`Planner.build`);
- remat's budget mode (`Planner.choose(shape, "budget", b)`) at `BUDGET_POINTS` budgets evenly from the
  smallest named plan's total up to off's (off excluded), plus the budget halfway between layer and off;
- PyTorch's per-decoder-layer `torch.utils.checkpoint` on the Hugging Face model (`bench`'s
  `torch_checkpoint`: eager, unchunked loss, as HF users get it);
- AOTAutograd's min-cut partitioner under `torch._functorch.config.activation_memory_budget`:
  `torch.compile` with the aot_eager backend (the partitioner is compared, not inductor's kernels) on remat's
  own loss function (same loss chunks), one compiled function per budget. Each remat budget maps to the
  share of off's planned graph that budget mode's choice there plans (AOT's fraction runs from saving the
  inputs alone to its default partition, which is close to saving everything); 1.0 is AOT's default.

How: every variant reads the same weights and the same batches; there is no optimizer step (the weights
stay put, so every step of every variant computes the same function and remat's losses and grads can be
compared with off's bitwise). A step is forward + backward, its grads included. Steps are interleaved
(round-robin over the variants, off first in each round); round 0 is the warm-up (remat traces and plans,
AOT compiles, outside it) and is the step whose memory is measured, the same way for all
(`bench.peak_during`: the allocator's bytes above the step's start, grads included); later rounds are timed.
A variant's time ratio is the median over the timed rounds of its step time over off's in the same round (off
ran just before it: drift of a shared machine hits both alike); its fastest step over off's fastest is beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.base.settings import GateRefused, MiB, TrainSettings, UsageError
from remat.bench.common import (
    Variant,
    eager_variant,
    peak_during,
    random_batches,
    remat_variant,
    sync,
)
from remat.bench.sweep_report import GRAPH_TARGET, TIME_TARGET_HALFWAY, markdown, write_outputs
from remat.core.graph import StepInputs
from remat.core.plan import Plan
from remat.models import adapters
from remat.models import load as models
from remat.models.hf import causal_lm_loss, prepare
from remat.training import gate
from remat.training.step import Planner, StepShape, policy_name

NAMED = ("off", "dots", "layer", "every:2", "every:4")
BUDGET_POINTS = 6  # evenly from the smallest plan's total to off's, off excluded (plus layer/off halfway)
AOT_FULL = 1.0  # AOTAutograd's default partition


# ---------------------------------------------------------------------------------------- the points


@dataclass
class Entry:
    """One variant of the sweep, with what the sweep adds to bench's `Variant`."""

    variant: Variant
    kind: str  # "remat", "remat_budget", "torch_checkpoint" or "aot"
    policy: str | None = None  # remat: the policy that runs (budget mode: the one it chose)
    budget: int | None = None  # remat_budget: the budget given to `Planner.choose`, bytes
    plan: Plan | None = None  # remat: the policy's plan
    aot_budget: float | None = None  # aot: activation_memory_budget
    compile_seconds: float | None = None
    grad_diffs: list[float] = field(default_factory=list)  # per step: max |grad - off's grad| over parameters

    @property
    def name(self) -> str:
        return self.variant.name


def budget_points(plans: dict[str, Plan], n: int = BUDGET_POINTS) -> list[int]:
    """`n` budgets evenly from the smallest plan's total to off's (off excluded), and layer/off halfway."""
    lo, hi = min(p.total for p in plans.values()), plans["off"].total
    evenly = {lo + (hi - lo) * k // n for k in range(n)}
    return sorted(evenly | {halfway_budget(plans)})


def halfway_budget(plans: dict[str, Plan]) -> int:
    return plans["layer"].total + (plans["off"].total - plans["layer"].total) // 2


def budget_name(budget: int, plans: dict[str, Plan]) -> str:
    """`budget@f`: f is where the budget lies from the smallest plan's total (0) to off's (1); the budget
    halfway between layer and off is `budget@half`."""
    if budget == halfway_budget(plans):
        return "budget@half"
    lo, hi = min(p.total for p in plans.values()), plans["off"].total
    return f"budget@{(budget - lo) / (hi - lo) if hi > lo else 0.0:.2f}"


def aot_fraction(graph: int, off: Plan) -> float:
    """AOT's activation_memory_budget matching a remat plan: its graph's share of off's, in [0.01, 1]."""
    return min(1.0, max(0.01, graph / off.graph)) if off.graph else AOT_FULL


def aot_budgets(chosen: Sequence[Plan], off: Plan) -> list[float]:
    """One AOT budget per plan budget mode chose (rounded to 0.01, duplicates merged) and AOT's default, 1.0."""
    return sorted({round(aot_fraction(p.graph, off), 2) for p in chosen} | {AOT_FULL})


# ---------------------------------------------------------------------------------------- variants


def _remat_entries(model: nn.Module, s: TrainSettings, plans: dict[str, Plan], budgets: Sequence[int],
                   say: Callable[[str], None]) -> tuple[list[Entry], list[dict]]:
    """The named policies, then budget mode at each budget; budgets the gate refuses are listed apart."""
    shape, planner = StepShape.of(s), Planner(model)
    entries = [Entry(remat_variant(name, model, s, name), "remat",
                     policy=policy_name(name), plan=plans[name]) for name in NAMED]
    refused = []
    for b in budgets:
        name = budget_name(b, plans)
        try:
            choice = planner.choose(shape, "budget", b)
        except GateRefused as e:
            say(f"{name} ({b / MiB:,.1f} MiB): refused by the gate")
            refused.append({"variant": name, "budget": b, "reason": str(e)})
            continue
        say(f"{name} ({b / MiB:,.1f} MiB): budget mode chose {choice.policy}, plan {choice.plan.total / MiB:,.1f} MiB")
        v = remat_variant(name, model, s, choice.policy, planner)
        entries.append(Entry(v, "remat_budget", policy=choice.policy, budget=b, plan=choice.plan))
    return entries, refused


def _budget_backend(fraction: float) -> Callable[..., Any]:
    """aot_eager with the budget set while it compiles: a new function per budget, so that dynamo keeps
    one cache entry per budget (its guards tell backends apart) and no budget runs another's partition."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return aot_eager(gm, example_inputs)

    return backend


def _aot_entry(model: nn.Module, fraction: float, loss_chunk: int, warm: tuple[torch.Tensor, torch.Tensor]) -> Entry:
    """AOTAutograd at one activation_memory_budget: remat's loss function compiled, autograd's backward."""
    params = list(StepInputs.of(model).trainable.values())
    compiled = torch.compile(functools.partial(causal_lm_loss, model, loss_chunk=loss_chunk),
                             backend=_budget_backend(fraction))

    def train_step(input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = compiled(input_ids, labels)
        loss.backward()
        return loss.item()

    def setup() -> None:  # compile (forward, partition, backward) on the first batch, outside the measurement
        t0 = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            train_step(*warm)
        entry.compile_seconds = time.perf_counter() - t0

    chunks = f"loss in chunks of {loss_chunk}" if loss_chunk else "unchunked loss"
    note = f"torch.compile aot_eager, activation_memory_budget {fraction:g}, {chunks}"
    entry = Entry(Variant(f"aot@{fraction:.2f}", model, train_step, setup, params, note), "aot", aot_budget=fraction)
    return entry


# ---------------------------------------------------------------------------------------- running


def _max_grad_diff(params: list[torch.Tensor], ref: list[torch.Tensor | None]) -> float:
    diffs = [0.0 if p.grad is None and r is None else float("inf") if p.grad is None or r is None
             else (p.grad - r).abs().max().item() for p, r in zip(params, ref)]
    return max(diffs, default=0.0)


def _one_step(e: Entry, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device, first: bool) -> float:
    """One step of one variant: the warm-up (setup, then measured) or a timed one; returns its loss."""
    v = e.variant
    if first:
        v.setup()
        for p in v.params:  # AOT's compile ran a step: its grads are not this step's
            p.grad = None
    t0 = time.perf_counter()
    if first:
        loss, v.measured_peak = peak_during(functools.partial(v.step, *batch), device)
    else:
        loss = v.step(*batch)
    sync(device)
    v.seconds.append(time.perf_counter() - t0)
    v.losses.append(loss)
    return loss


def run_rounds(entries: list[Entry], data: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
               say: Callable[[str], None]) -> None:
    """Round-robin over the variants, off first: round 0 warms up and measures, the rest are timed.
    After each step its grads are compared with off's of the same round, then dropped."""
    off = entries[0]
    assert off.name == "off"
    recompiles = max(8, len(entries) + 4)  # one cache entry per AOT budget on the same code
    for i, batch in enumerate(data):
        with torch._dynamo.config.patch(recompile_limit=recompiles, error_on_recompile=i > 0):
            ref: list[torch.Tensor | None] = []
            for e in entries:
                loss = _one_step(e, batch, device, i == 0)
                if e is off:
                    ref = [p.grad for p in e.variant.params]
                e.grad_diffs.append(_max_grad_diff(e.variant.params, ref))
                for p in e.variant.params:
                    p.grad = None
                say(f"round {i}/{len(data) - 1} {e.name:<16} loss {loss:.6f}  {e.variant.seconds[-1]:.3f} s"
                    + ("  (warm-up, measured)" if i == 0 else ""))


def _median_ratio(seconds: list[float], off: list[float]) -> float | None:
    """The median over the timed rounds of the step's time over off's in the same round."""
    ratios = [a / b for a, b in zip(seconds[1:], off[1:]) if b > 0]
    return statistics.median(ratios) if ratios else None


def entry_result(e: Entry, off: Entry) -> dict:
    """bench's per-variant result, with the sweep's fields."""
    v, timed, off_timed = e.variant, e.variant.seconds[1:], off.variant.seconds[1:]
    bitwise = len(v.losses) == len(off.variant.losses) and all(
        float(x).hex() == float(y).hex() for x, y in zip(v.losses, off.variant.losses))
    return v.result() | {
        "kind": e.kind, "policy": e.policy, "budget": e.budget, "planned_total": e.plan and e.plan.total,
        "aot_budget": e.aot_budget, "compile_seconds": e.compile_seconds,
        "step_seconds_min": min(timed) if timed else None,
        "time_ratio": _median_ratio(v.seconds, off.variant.seconds),
        "time_ratio_min": min(timed) / min(off_timed) if timed and off_timed else None,
        "losses_equal_off_bitwise": bitwise,
        "loss_max_abs_diff_vs_off": max((abs(x - y) for x, y in zip(v.losses, off.variant.losses)), default=0.0),
        "grad_max_abs_diff_vs_off": max(e.grad_diffs, default=0.0),
    }


# ---------------------------------------------------------------------------------------- the sweep


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _models(model: str | None, ctx: int, lora: bool, seed: int,
            device: torch.device) -> tuple[Any, nn.Module, nn.Module]:
    """The loaded model, the shared copy (remat and AOT) and torch checkpointing's own copy."""
    loaded = models.load_model(model, seed=seed, as_stored=lora)  # full fine-tuning trains float32 weights
    models.check_ctx(ctx, loaded.model.config)
    base: nn.Module = loaded.model.to(device)  # type: ignore[arg-type]  # transformers types .to oddly
    ckpt = copy.deepcopy(base)  # before any use: enabling checkpointing changes the model it is enabled on
    if lora:  # the same seed: both start from the same adapter
        base, ckpt = (adapters.apply_lora(m, adapters.LoraSettings(), seed=seed) for m in (base, ckpt))
    prepare(base)  # before compiling: preparing registers hooks, which dynamo would break the graph on
    return loaded, base, ckpt


def run_sweep(model: str | None, ctx: int, batch: int = 1, steps: int = 3,
              loss_chunk: int | None = None, out: str | Path | None = None,
              *, lora: bool = False, seed: int = 0, budget_points_n: int = BUDGET_POINTS,
              progress: bool = True) -> dict:
    """Plan, run the variants interleaved for `steps` rounds (the first the warm-up), summarize, write."""
    if steps < 2:
        raise UsageError(f"--steps must be at least 2 (the first round is the warm-up), got {steps}")
    s = TrainSettings(model=model, ctx=ctx, batch=batch, steps=steps, seed=seed, loss_chunk=loss_chunk, lora=lora,
                      dtype="float32")  # as the variants beside remat's (torch's checkpointing, AOTAutograd)
    device = _device()

    def say(text: str) -> None:
        if progress:
            print(f"sweep: {text}", file=sys.stderr, flush=True)

    loaded, base, ckpt = _models(model, ctx, lora, seed, device)
    s = gate.settled(s, loaded.model.config)  # the loss chunk the trainer would choose
    loss_chunk = s.loss_chunk
    assert loss_chunk is not None
    vocab = loaded.model.config.vocab_size
    data = [(ids.to(device), labels.to(device)) for ids, labels in random_batches(vocab, batch, ctx, steps, seed)]
    with contextlib.nullcontext() if device.type == "cpu" else torch.device(device):
        t0 = time.perf_counter()
        plans = Planner(base).plans(StepShape.of(s), NAMED)
        budgets = budget_points(plans, budget_points_n)
        entries, refused = _remat_entries(base, s, plans, budgets, say)
        say(f"planned in {time.perf_counter() - t0:.1f} s")
        entries.append(Entry(eager_variant("torch_checkpoint", ckpt, True), "torch_checkpoint"))
        chosen = [e.plan for e in entries if e.kind == "remat_budget" and e.plan is not None]
        entries += [_aot_entry(base, x, loss_chunk, data[0]) for x in aot_budgets(chosen, plans["off"])]
        say(f"{loaded.name}, ctx {ctx}, batch {batch}, {len(entries)} variants, {steps} rounds on {device.type}")
        torch._dynamo.reset()
        run_rounds(entries, data, device, say)
    result = {
        "sweep": True, "model": loaded.name, "ctx": ctx, "batch": batch, "path": "window",
        "lora": adapters.LoraSettings().r if lora else None, "parameters": sum(p.numel() for p in base.parameters()),
        "loss_chunk": loss_chunk, "steps": steps,
        "device": device.type if device.type == "cpu" else f"cuda ({torch.cuda.get_device_name(device)})",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "data": f"random tokens, seed {seed}",
        "plans": {k: p.as_dict() for k, p in plans.items()}, "budgets": budgets,
        "halfway_budget": halfway_budget(plans), "refused": refused,
        "variants": [entry_result(e, entries[0]) for e in entries],
    }
    result |= summarize(result)
    if out is not None:
        write_outputs(result, Path(out))
    return result


# ---------------------------------------------------------------------------------------- targets


def _remat_points(result: dict) -> list[dict]:
    return [v for v in result["variants"] if v["kind"] in ("remat", "remat_budget")]


def frontier(points: list[dict]) -> list[dict]:
    """The Pareto frontier over (measured peak, time ratio): points that nothing beats on both."""
    best: list[dict] = []
    for v in sorted(points, key=lambda v: (v["measured_peak"], v["time_ratio"])):
        if not best or v["time_ratio"] < best[-1]["time_ratio"]:
            best.append(v)
    return best


def remat_at(points: list[dict], peak: int) -> dict | None:
    """remat's fastest point whose measured peak is at most `peak` (the frontier read as a step function)."""
    fits = [v for v in points if v["measured_peak"] <= peak]
    return min(fits, key=lambda v: v["time_ratio"]) if fits else None


def interpolated(front: list[dict], peak: int) -> float | None:
    """The frontier's time ratio at `peak`, linear between its points; None outside them."""
    for a, b in itertools.pairwise(front):
        if a["measured_peak"] <= peak <= b["measured_peak"]:
            span = b["measured_peak"] - a["measured_peak"]
            w = (peak - a["measured_peak"]) / span if span else 0.0
            return a["time_ratio"] + w * (b["time_ratio"] - a["time_ratio"])
    return None


def _versus_aot(result: dict) -> list[dict]:
    """(c) per AOT point: remat's fastest point within its measured memory, and whether it is no slower."""
    remat = _remat_points(result)
    front = frontier(remat)
    rows = []
    for a in (v for v in result["variants"] if v["kind"] == "aot"):
        r = remat_at(remat, a["measured_peak"])
        rows.append({"aot": a["variant"], "aot_peak": a["measured_peak"], "aot_time_ratio": a["time_ratio"],
                     "remat": r and r["variant"], "remat_peak": r and r["measured_peak"],
                     "remat_time_ratio": r and r["time_ratio"],
                     "remat_interpolated_time_ratio": interpolated(front, a["measured_peak"]),
                     "met": r is not None and r["time_ratio"] <= a["time_ratio"]})
    return rows


def summarize(result: dict) -> dict:
    """The frontier, loss equality and the targets (a), (b), (c), as measured."""
    by = {v["variant"]: v for v in result["variants"]}
    plans, remat = result["plans"], _remat_points(result)
    halfway = next((v for v in remat if v["budget"] == result["halfway_budget"]), None)
    smallest = min((v for v in remat if v["kind"] == "remat_budget"), key=lambda v: v["budget"], default=None)
    layer_graph = plans["layer"]["graph"]
    graphs = {n: v["planned_graph"] for n, v in (("every:4", by.get("every:4")), ("smallest budget", smallest)) if v}
    versus = _versus_aot(result)
    bitwise = all(v["losses_equal_off_bitwise"] for v in remat)
    targets = {
        "a_halfway_time_le_1.05": halfway is not None and halfway["time_ratio"] <= TIME_TARGET_HALFWAY,
        "b_graph_le_0.6_layer": any(g <= GRAPH_TARGET * layer_graph for g in graphs.values()),
        "c_remat_no_slower_than_aot": bool(versus) and all(r["met"] for r in versus),
        "remat_losses_equal_off_bitwise": bitwise,
    }
    return {
        "frontier": [v["variant"] for v in frontier(remat)],
        "halfway": halfway and halfway["variant"],
        "graph_over_layer": {n: g / layer_graph for n, g in graphs.items()},
        "versus_aot": versus,
        "loss_equality": {"remat_equal_off_bitwise": bitwise,
                          "remat_grads_equal_off_bitwise": all(v["grad_max_abs_diff_vs_off"] == 0 for v in remat)},
        "targets": targets,
    }


# ---------------------------------------------------------------------------------------- outputs


def main(args: argparse.Namespace) -> int:
    if args.path != "window":
        raise UsageError("--sweep runs the window path (--path window)")
    result = run_sweep(args.model, args.ctx, args.batch, args.steps, args.loss_chunk, args.out, lora=args.lora)
    print(json.dumps(result) if args.json else markdown(result) + f"\nwritten to {args.out}/")
    return 0
