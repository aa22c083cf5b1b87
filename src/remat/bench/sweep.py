"""`remat bench --sweep`: a Pareto sweep, memory (planned and measured) against step time.

Compared on one model and one window shape (the window path), side by side in one process:

- remat's named recompute policies `off`, `dots`, `layer` (= `on`), `every:2`, `every:4` (`step.build`);
- remat's budget mode (`step.choose(model, shape, "budget", b)`) at `BUDGET_POINTS` budgets evenly from the
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
from remat.bench import compare as bench
from remat.bench.compare import (
    Variant,
    _eager_variant,
    _mib,
    _remat_variant,
    _secs,
    _sync,
    _training,
    _x,
    peak_during,
    random_batches,
)
from remat.core.graph import StepInputs
from remat.core.plan import Plan
from remat.models import adapters
from remat.models import load as models
from remat.models.hf import causal_lm_loss, prepare
from remat.training import step

NAMED = ("off", "dots", "layer", "every:2", "every:4")
BUDGET_POINTS = 6  # evenly from the smallest plan's total to off's, off excluded (plus layer/off halfway)
TIME_TARGET_HALFWAY = 1.05  # (a) at the budget halfway between layer and off: step time <= 1.05 x off
GRAPH_TARGET = 0.6  # (b) every:4 (or the smallest budget point) plans <= 0.6 x layer's graph
AOT_FULL = 1.0  # AOTAutograd's default partition


# ---------------------------------------------------------------------------------------- the points


@dataclass
class Entry:
    """One variant of the sweep, with what the sweep adds to bench's `Variant`."""

    variant: Variant
    kind: str  # "remat", "remat_budget", "torch_checkpoint" or "aot"
    policy: str | None = None  # remat: the policy that runs (budget mode: the one it chose)
    budget: int | None = None  # remat_budget: the budget given to `step.choose`, bytes
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
    shape = step.StepShape.of(s)
    entries = [Entry(_remat_variant(name, model, s, name), "remat",
                     policy=step.policy_name(name), plan=plans[name]) for name in NAMED]
    refused = []
    for b in budgets:
        name = budget_name(b, plans)
        try:
            choice = step.choose(model, shape, "budget", b)
        except GateRefused as e:
            say(f"{name} ({b / MiB:,.1f} MiB): refused by the gate")
            refused.append({"variant": name, "budget": b, "reason": str(e)})
            continue
        say(f"{name} ({b / MiB:,.1f} MiB): budget mode chose {choice.policy}, plan {choice.plan.total / MiB:,.1f} MiB")
        v = _remat_variant(name, model, s, choice.policy)
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
    _sync(device)
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
              loss_chunk: int = TrainSettings.model_fields["loss_chunk"].default, out: str | Path | None = None,
              *, lora: bool = False, seed: int = 0, budget_points_n: int = BUDGET_POINTS,
              progress: bool = True) -> dict:
    """Plan, run the variants interleaved for `steps` rounds (the first the warm-up), summarize, write."""
    if steps < 2:
        raise UsageError(f"--steps must be at least 2 (the first round is the warm-up), got {steps}")
    s = TrainSettings(model=model, ctx=ctx, batch=batch, steps=steps, seed=seed, loss_chunk=loss_chunk, lora=lora)
    device = _device()

    def say(text: str) -> None:
        if progress:
            print(f"sweep: {text}", file=sys.stderr, flush=True)

    loaded, base, ckpt = _models(model, ctx, lora, seed, device)
    vocab = loaded.model.config.vocab_size
    data = [(ids.to(device), labels.to(device)) for ids, labels in random_batches(vocab, batch, ctx, steps, seed)]
    with contextlib.nullcontext() if device.type == "cpu" else torch.device(device):
        t0 = time.perf_counter()
        plans = step.plans(base, step.StepShape.of(s), NAMED)
        budgets = budget_points(plans, budget_points_n)
        entries, refused = _remat_entries(base, s, plans, budgets, say)
        say(f"planned in {time.perf_counter() - t0:.1f} s")
        entries.append(Entry(_eager_variant("torch_checkpoint", ckpt, True), "torch_checkpoint"))
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


def title(result: dict) -> str:
    return f"{result['model']}, ctx {result['ctx']}, batch {result['batch']}, {_training(result)}, {result['device']}"


def _table(result: dict) -> list[str]:
    lines = ["| variant | kind | policy | budget MiB | planned total MiB | planned graph MiB | measured graph MiB "
             "| measured peak MiB | step s med | step s min | time / off (median) | time / off (min) | loss == off |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v in result["variants"]:
        same = "bitwise" if v["losses_equal_off_bitwise"] else f"max diff {v['loss_max_abs_diff_vs_off']:.3g}"
        lines.append(f"| `{v['variant']}` | {v['kind']} | {v['policy'] or '–'} | {_mib(v['budget'])} "
                     f"| {_mib(v['planned_total'])} | {_mib(v['planned_graph'])} | {_mib(v['measured_graph'])} "
                     f"| {_mib(v['measured_peak'])} | {_secs(v['step_seconds'])} | {_secs(v['step_seconds_min'])} "
                     f"| {_x(v['time_ratio'])} | {_x(v['time_ratio_min'])} | {same} |")
    return lines


def _target_lines(result: dict) -> list[str]:
    by = {v["variant"]: v for v in result["variants"]}
    tg, half = result["targets"], by.get(result["halfway"] or "")

    def verdict(key: str) -> str:
        return "**met**" if tg[key] else "**NOT met**"

    graphs = ", ".join(f"{n} {r:.3f}×" for n, r in result["graph_over_layer"].items())
    lines = [
        "## Targets, as measured",
        "",
        (f"- (a) at the budget halfway between `layer` and `off` ({_mib(half and half['budget'])} MiB, "
         f"`{result['halfway']}`, chose `{half and half['policy']}`) step time ≤ {TIME_TARGET_HALFWAY} × off: "
         f"{_x(half and half['time_ratio'])}, {verdict('a_halfway_time_le_1.05')}."),
        (f"- (b) `every:4` (or the smallest budget point) plans ≤ {GRAPH_TARGET} × `layer`'s graph: {graphs}, "
         f"{verdict('b_graph_le_0.6_layer')}."),
        ("- (c) at every AOT budget remat is no slower than AOTAutograd at the same measured memory (remat's "
         "fastest point with measured peak ≤ AOT's; beside it, remat's frontier interpolated at AOT's peak, for "
         f"reference): {verdict('c_remat_no_slower_than_aot')}."),
    ]
    for r in result["versus_aot"]:
        remat = (f"`{r['remat']}` {_mib(r['remat_peak'])} MiB, {_x(r['remat_time_ratio'])}" if r["remat"]
                 else "no remat point at or below that memory")
        lines.append(f"  - `{r['aot']}` {_mib(r['aot_peak'])} MiB, {_x(r['aot_time_ratio'])} vs {remat} "
                     f"(interpolated {_x(r['remat_interpolated_time_ratio'])}): {'met' if r['met'] else 'NOT met'}")
    lines.append(f"- remat's losses equal off's bitwise, every variant and step: "
                 f"{verdict('remat_losses_equal_off_bitwise')} (grads bitwise too: "
                 f"{'yes' if result['loss_equality']['remat_grads_equal_off_bitwise'] else 'NO'}).")
    return lines


def markdown(result: dict) -> str:
    refused = [f"`{r['variant']}` ({_mib(r['budget'])} MiB)" for r in result["refused"]]
    lines = [
        f"# remat bench --sweep: {title(result)}",
        "",
        (f"{result['steps']} rounds, round-robin over the variants (off first); round 0 is the warm-up and the "
         f"measured step, the rest are timed; time / off (median), which the targets use, is the median over timed "
         f"rounds of the step's time over off's in the same round; time / off (min) is the fastest timed step over "
         f"off's fastest. Step = forward + backward with grads, no optimizer step (all variants read "
         f"the same weights). {result['data']}; torch {result['torch']}, {result['threads']} threads."),
        "",
        *_table(result),
        "",
        f"remat's Pareto frontier (measured peak vs time): {', '.join(f'`{n}`' for n in result['frontier'])}.",
        *(["", f"Budgets the gate refused: {', '.join(refused)}."] if refused else []),
        "",
        *_target_lines(result),
        "",
        ("Measured peak: bytes allocated above the step's start while forward and backward run (grads included), "
         "the same way for all variants "
         + ("(profiler allocation events)" if result["device"] == "cpu" else "(`torch.cuda.max_memory_allocated`)")
         + "; planned: remat's plan (total: what the gate holds against a budget, `remat.core.plan`; graph: the graph "
         "alone, no grads). "
         "`budget@f`: budget mode at a budget a fraction f of the way from the smallest named plan's total to "
         "off's; `budget@half`: halfway between layer's total and off's. `aot@x`: "
         "`torch.compile(backend=\"aot_eager\")` of remat's loss function (same loss chunks) with "
         "`activation_memory_budget` x (matching a budget point: the share of off's planned graph that budget "
         "mode's choice plans; 1.0 is AOT's default partition), autograd's backward. `torch_checkpoint`: the HF "
         "model, per-layer `torch.utils.checkpoint`, unchunked loss."),
    ]
    return "\n".join(lines) + "\n"


def _label_offsets(points: list[dict]) -> list[int]:
    """Vertical label offsets, in points: a label near earlier ones (close in memory and time) goes below them."""
    xs, ys = [v["measured_peak"] for v in points], [v["time_ratio"] for v in points]
    dx, dy = 0.03 * (max(xs) - min(xs) or 1), 0.03 * (max(ys) - min(ys) or 1)
    offsets = []
    for i in range(len(points)):
        near = sum(abs(xs[i] - xs[j]) < dx and abs(ys[i] - ys[j]) < dy for j in range(i))
        offsets.append(4 - 9 * near)
    return offsets


def plot(result: dict, dest: Path) -> bool:
    """Measured peak vs time ratio to off, every point labelled; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"remat": ("tab:blue", "o", "remat policy"), "remat_budget": ("tab:green", "s", "remat budget mode"),
             "torch_checkpoint": ("tab:orange", "^", "torch per-layer checkpoint"),
             "aot": ("tab:red", "D", "AOTAutograd activation_memory_budget")}
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=120)
    for kind, (color, marker, label) in style.items():
        pts = [v for v in result["variants"] if v["kind"] == kind]
        if pts:
            ax.scatter([v["measured_peak"] / MiB for v in pts], [v["time_ratio"] for v in pts], s=55, color=color,
                       marker=marker, zorder=3, label=label)
    for v, dy in zip(result["variants"], _label_offsets(result["variants"])):
        ax.annotate(v["variant"], (v["measured_peak"] / MiB, v["time_ratio"]), textcoords="offset points",
                    xytext=(5, dy), fontsize=7, color=style[v["kind"]][0])
    by = {v["variant"]: v for v in result["variants"]}
    front = [by[n] for n in result["frontier"]]
    ax.step([v["measured_peak"] / MiB for v in front], [v["time_ratio"] for v in front], where="post",
            color="tab:blue", alpha=0.4, linestyle="--", label="remat frontier")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("measured peak, MiB (forward + backward, grads included)")
    ax.set_ylabel("step time / off (median over rounds)")
    ax.set_title(f"remat bench --sweep: {title(result)}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(dest, format="png")
    plt.close(fig)
    return True


def write_outputs(result: dict, out: Path) -> list[str]:
    return bench.write_outputs(result, out, markdown, plot)


def main(args: argparse.Namespace) -> int:
    if args.path != "window":
        raise UsageError("--sweep runs the window path (--path window)")
    result = run_sweep(args.model, args.ctx, args.batch, args.steps, args.loss_chunk, args.out, lora=args.lora)
    print(json.dumps(result) if args.json else markdown(result) + f"\nwritten to {args.out}/")
    return 0
