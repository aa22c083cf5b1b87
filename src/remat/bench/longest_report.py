"""`longest_window`'s arithmetic and report: the fit of measured peaks, the longest window within a budget, the rows
the model's maximum context caps or its weights do not fit, and bench.json / bench.md / bench.png."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
F32 = 4  # bytes per float32 weight
# What each side holds per weight before any activation, with full fine-tuning: the weight, AdamW's two moments and,
# on both sides here, one set of grads (Hugging Face: `.grad`; remat's walk: the window's gradient sums).
FULL_COPIES = {"remat": 4, "hf": 4}
SIDE_NAMES = {"remat": "remat, float32 weights (walk, recompute on)",
              "blocks": "remat on the GGUF's blocks (walk, recompute on)", "hf": "HF + PEFT + checkpointing"}


def sides(mode: str) -> tuple[str, ...]:
    """The sides measured: remat on float32 weights and, with LoRA, on the weights as the GGUF stores them (full
    fine-tuning trains float32 copies of a quantized base: the same job as the first), and Hugging Face."""
    return (("remat", "blocks") if mode == "lora" else ("remat",)) + ("hf",)


@functools.cache
def parameter_count(spec: str | None) -> int:
    """The model's parameters, counted on the meta device from its config (no weights made)."""
    import torch
    import transformers

    from remat.models import load as models
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(models.load_config(spec))
    return sum(p.numel() for p in m.parameters())


@functools.cache
def max_context(spec: str | None) -> int:
    from remat.models import load as models
    return models.max_ctx(models.load_config(spec))


def floor_bytes(n_params: int, side: str, mode: str, frozen: int | None = None) -> int:
    """What `side` holds before any activation: the frozen weights (LoRA; the adapter is a rounding error: float32,
    or on the blocks side `frozen`, the bytes its plans hold), or the weights with their grads and optimizer state
    (full)."""
    if mode == "full":
        return n_params * F32 * FULL_COPIES[side]
    return frozen or 0 if side == "blocks" else n_params * F32


def fit(points: Sequence[tuple[int, int]]) -> list[float] | None:
    """Least squares of peak against window: [a, b] (a + b·n) through two windows, [a, b, c] (+ c·n², c ≥ 0) from three
    on (a parabola that bends down would promise windows no run showed: then the line). None under two."""
    import numpy as np
    if len({n for n, _ in points}) < 2:
        return None
    xs, ys = np.array([float(n) for n, _ in points]), np.array([float(p) for _, p in points])
    if len(set(xs)) >= 3:
        c, b, a = np.polyfit(xs, ys, 2)
        if c >= 0:
            return [float(a), float(b), float(c)]
    b, a = np.polyfit(xs, ys, 1)
    return [float(a), float(b)]


def predict(coef: Sequence[float], n: float) -> float:
    return sum(k * n**i for i, k in enumerate(coef))


def longest(coef: Sequence[float], budget: int) -> float:
    """The longest window whose fitted peak is within `budget` (inf where the peak does not grow; 0 where none fits)."""
    a, b = coef[0], coef[1]
    c = coef[2] if len(coef) > 2 else 0.0
    if c > 0:
        disc = b * b - 4 * c * (a - budget)
        return max(0.0, (-b + disc**0.5) / (2 * c)) if disc >= 0 else 0.0
    if b <= 0:
        return float("inf") if a <= budget else 0.0
    return max(0.0, (budget - a) / b)


def piecewise_longest(points: Sequence[tuple[int, float]], budget: int) -> float:
    """The longest window within `budget` on the broken line through `points` (past the last, its last segment goes
    on; inf where that one does not grow)."""
    pts = sorted(points)
    if pts[0][1] > budget:
        return 0.0
    for (n0, p0), (n1, p1) in itertools.pairwise(pts):
        if p1 > budget:
            return n0 + (budget - p0) * (n1 - n0) / (p1 - p0)
    (n0, p0), (n1, p1) = pts[-2], pts[-1]
    slope = (p1 - p0) / (n1 - n0)
    return float("inf") if slope <= 0 else n1 + (budget - p1) / slope


def anchored(plans: dict[int, int], measured: Sequence[tuple[int, int]], offset: int | None = None
             ) -> list[tuple[int, float]] | None:
    """remat's curve: its planned totals, moved by what the measured runs held beyond their plans (the runtime, the
    trace, the allocator: the median of measured - planned over the measured windows; without one, `offset`, what
    another model's runs held). None without plans or an offset."""
    gaps = sorted(p - plans[n] for n, p in measured if n in plans)
    if gaps:
        offset = gaps[len(gaps) // 2]
    if offset is None or len(plans) < 2:
        return None
    return [(n, t + offset) for n, t in sorted(plans.items())]


def borrowed_offset(runs: list[dict], side: str, mode: str) -> int | None:
    """What remat's measured runs of `side` held beyond their plans, over every model measured with `mode` (for a
    model remat only plans here)."""
    labels = {r["model"] for r in runs if r["side"] == side and r["purpose"] == "fit" and r["mode"] == mode}
    gaps = sorted(p - plans[n] for label in labels for plans in [_plans(runs, label, side, mode)]
                  for n, p in _points(runs, label, side, mode) if n in plans)
    return gaps[len(gaps) // 2] if gaps else None


def side_row(raw: float | None, budget: int, floor: int, cap: int, confirms: dict[int, int | None]) -> dict[str, Any]:
    """One side at one budget, from its longest window `raw` (None: not measured): status `weights` (the floor alone
    exceeds the budget), `unmeasured`, `none` (no window fits), `capped` (the model's maximum context comes first)
    or `fit`; the window, and the confirming run's peak where one ran at that window (`confirms`: window -> peak,
    None when it failed)."""
    row: dict[str, Any] = {"floor": floor, "cap": cap}
    if floor >= budget:
        return row | {"status": "weights", "window": None}
    if raw is None:
        return row | {"status": "unmeasured", "window": None}
    row["fit_window"] = None if raw == float("inf") else int(raw)
    if raw >= cap:
        row |= {"status": "capped", "window": cap}
    elif raw < 1:
        row |= {"status": "none", "window": 0}
    else:
        row |= {"status": "fit", "window": int(raw)}
    if row["window"] and row["window"] in confirms:
        peak = confirms[row["window"]]
        row["confirm_peak"] = peak
        row["confirmed"] = peak is not None and peak <= budget
    return row


def raw_window(runs: list[dict], label: str, side: str, mode: str, budget: int) -> float | None:
    """The side's longest window within `budget`: Hugging Face's from the fit of its training phase's measured peaks
    (0 where loading the model alone peaks over the budget), remat's from its plans anchored on its measured peaks
    (`anchored`); never below the longest window a measured run held within the budget (a run is the evidence
    the fit stands in for)."""
    points = _points(runs, label, side, mode)
    if side != "hf":
        curve = anchored(_plans(runs, label, side, mode), points, borrowed_offset(runs, side, mode))
        found = None if curve is None else piecewise_longest(curve, budget)
    else:
        coef = fit(points)
        found = None if coef is None else 0.0 if _load_peak(runs, label, side, mode) > budget else longest(coef,
                                                                                                            budget)
    held = [r["ctx"] for r in runs if (r["model"], r["side"], r["mode"]) == (label, side, mode)
            and r["purpose"] in ("fit", "confirm") and r["peak_rss"]
            and max(r["peak_rss"], r.get("load_peak_rss") or 0) <= budget]  # the whole process held it
    return found if found is None else max([found, *held])


def ratio(remat: dict, hf: dict) -> tuple[float | None, str]:
    """remat's window over HF's, and how to read it: exact (neither capped), a lower bound (remat capped), or none."""
    if remat["status"] not in ("fit", "capped") or hf["status"] not in ("fit", "capped") or not hf["window"]:
        if remat["status"] in ("fit", "capped") and hf["status"] in ("weights", "none"):
            return None, "HF fits no window"
        return None, ""
    r = remat["window"] / hf["window"]
    if remat["status"] == "capped" and hf["status"] == "capped":
        return r, "both capped"
    if remat["status"] == "capped":
        return r, "at least (remat capped)"
    if hf["status"] == "capped":
        return r, "HF capped"
    return r, "exact"


def _points(runs: list[dict], label: str, side: str, mode: str) -> list[tuple[int, int]]:
    """(window, peak) of the side's measured runs: the fit's, and a confirming run that went over the budget it
    was run for (a line through two short windows can promise far more than a long one holds; one within its
    budget confirms the window and leaves the fit as it is): the training phase's peak where the child reported
    it apart from its load's (the Hugging Face child), else the whole process's."""
    return [(r["ctx"], _peak(r)) for r in runs
            if (r["model"], r["side"], r["mode"]) == (label, side, mode) and r["peak_rss"] and _refits(r)]


def _refits(r: dict) -> bool:
    """A fit's run, or a confirming run over the budget it was run for."""
    return r["purpose"] == "fit" or (r["purpose"] == "confirm" and _peak(r) > r.get("budget", float("inf")))


def _peak(r: dict) -> int:
    return r.get("train_peak_rss") or r["peak_rss"]


def _load_peak(runs: list[dict], label: str, side: str, mode: str) -> int:
    """The highest peak of the runs' load phase (0 where none was reported apart)."""
    return max((r.get("load_peak_rss") or 0 for r in runs
                if (r["model"], r["side"], r["mode"]) == (label, side, mode) and r["purpose"] in ("fit", "confirm")),
               default=0)


def _plans(runs: list[dict], label: str, side: str, mode: str) -> dict[int, int]:
    return {r["ctx"]: r["planned_total"] for r in runs
            if (r["model"], r["side"], r["mode"], r["purpose"]) == (label, side, mode, "plan")}


def _frozen(runs: list[dict], label: str, side: str, mode: str) -> int | None:
    """The frozen weights' bytes in the side's plans (None without a plan that says)."""
    return next((r["planned_frozen"] for r in runs if (r["model"], r["side"], r["mode"], r["purpose"]) ==
                 (label, side, mode, "plan") and "planned_frozen" in r), None)


def _confirms(runs: list[dict], label: str, side: str, mode: str) -> dict[int, int | None]:
    return {r["ctx"]: r["peak_rss"] for r in runs
            if (r["model"], r["side"], r["mode"], r["purpose"]) == (label, side, mode, "confirm")}


def rows(cases: Sequence[Any], runs: list[dict], budgets: Sequence[int], target: float) -> list[dict]:
    """Every (model, training, budget) row: each side, remat's ratios to Hugging Face (`ratio`: on the same float32
    weights, the one the target is for; `blocks_ratio`: on the GGUF's blocks)."""
    out = []
    for case in cases:
        n, cap = parameter_count(case.spec), max_context(case.spec)
        for mode in ("lora", "full"):
            for gib in budgets:
                row: dict[str, Any] = {"model": case.label, "spec": case.spec, "mix": getattr(case, "mix", None),
                                       "mode": mode, "budget_gib": gib, "parameters": n}
                for side in sides(mode):
                    row[side] = side_row(raw_window(runs, case.label, side, mode, gib * GiB), gib * GiB,
                                         floor_bytes(n, side, mode, _frozen(runs, case.label, side, mode)), cap,
                                         _confirms(runs, case.label, side, mode))
                    if side != "hf" and not _points(runs, case.label, side, mode) and \
                            row[side]["status"] in ("fit", "capped"):
                        row[side]["plan_only"] = True
                r, note = ratio(row["remat"], row["hf"])
                row |= {"ratio": r, "ratio_note": note,
                        "target_met": None if note != "exact" else r is not None and r >= target}
                if "blocks" in row:
                    row["blocks_ratio"], row["blocks_ratio_note"] = ratio(row["blocks"], row["hf"])
                out.append(row)
    return out


def confirmations(cases: Sequence[Any], runs: list[dict], budgets: Sequence[int]
                  ) -> list[tuple[Any, str, str, int, int]]:
    """The confirming runs the rows ask for: each side's found window (the cap, where capped) up to the case's
    `confirm_max`, each window once with the smallest budget (GiB) that asks for it, shortest first."""
    want: dict[tuple, tuple[Any, int]] = {}
    for row in rows(cases, runs, budgets, 0.0):
        case = next(c for c in cases if c.label == row["model"])
        for side in sides(row["mode"]):
            w = row[side]["window"]
            if row[side]["status"] in ("fit", "capped") and w and w <= case.confirm_max:
                want.setdefault((case.label, side, row["mode"], w), (case, row["budget_gib"]))
    return sorted(((c, s, m, w, gib) for (_, s, m, w), (c, gib) in want.items()), key=lambda t: t[3])


# ------------------------------------------------------------------------------------------ the report


def cell(side: dict) -> str:
    st = side["status"]
    if st == "weights":
        return f"weights do not fit ({side['floor'] / MiB:,.0f} MiB before activations)"
    if st == "unmeasured":
        return "not measured"
    if st == "none":
        return "0 (no window fits)"
    text = f"{side['window']:,}" + (" (capped: the model's maximum context)" if st == "capped" else "")
    if "confirmed" in side:
        peak = side["confirm_peak"]
        text += (f", confirmed: {peak / MiB:,.0f} MiB" if side["confirmed"] else
                 f", run there: {'failed' if peak is None else f'{peak / MiB:,.0f} MiB, over the budget'}")
    elif side.get("plan_only"):
        text += ", plan only (no run: remat plans this preset, it does not train it)"
    else:
        text += ", fit only (not run here)"
    return text


def _note(r: dict) -> str:
    if r.get("error"):
        return r["error"]
    if r.get("load_peak_rss"):
        return f"training's peak; loading peaked at {r['load_peak_rss'] / MiB:,.0f}"
    return ""


def ratio_text(r: float | None, note: str) -> str:
    if r is None:
        return note or "–"
    return f"{r:.2f}×" + ("" if note == "exact" else f" ({note})")


def markdown(res: dict) -> str:
    lines = ["# Longest training window within a memory budget: remat against Hugging Face + PEFT", "",
             "| model | training | budget | remat, float32 weights | remat, the GGUF's blocks "
             "| HF + PEFT + gradient checkpointing (float32 weights) | remat / HF (float32) | blocks / HF | ≥ 2× |",
             "|---|---|---:|---|---|---|---|---|---|"]
    for r in res["rows"]:
        met = {True: "yes", False: "NO", None: "–"}[r["target_met"]]
        blocks = "as float32 (full fine-tuning trains float32 copies of the weights)"
        if "blocks" in r:
            blocks = cell(r["blocks"]) + (f" (at {r['mix'].upper()})" if r["mix"] else "")
        lines.append(f"| {r['model']} | {'LoRA r8' if r['mode'] == 'lora' else 'full'} | {r['budget_gib']} GiB "
                     f"| {cell(r['remat'])} | {blocks} | {cell(r['hf'])} | {ratio_text(r['ratio'], r['ratio_note'])} "
                     f"| {ratio_text(r.get('blocks_ratio'), r.get('blocks_ratio_note', ''))} | {met} |")
    lines += ["", "Windows in tokens, batch 1, every side computing in float32. Measured runs (one step each, a child "
              "process's peak resident set):", "",
              "| model | side | training | window | purpose | peak MiB | seconds | note |",
              "|---|---|---|---:|---|---:|---:|---|"]
    for r in res["runs"]:
        peak = "–" if r["peak_rss"] is None else f"{r['peak_rss'] / MiB:,.0f}"
        if r["purpose"] == "plan":
            peak = f"planned {r['planned_total'] / MiB:,.0f}"
        lines.append(f"| {r['model']} | {SIDE_NAMES[r['side']]} | {r['mode']} | {r['ctx']:,} | {r['purpose']} | {peak} "
                     f"| {r['seconds']:,.0f} | {_note(r)} |")
    lines += ["", res["method"], "", f"Machine: {res['machine']}."]
    return "\n".join(lines) + "\n"


METHOD = ("Hugging Face + PEFT: one training step at each of a few short windows in a child process, its peak "
          "resident set (`ru_maxrss`: weights, optimizer state, activations, the runtime), a line through the peaks "
          "(a parabola from three windows on, never bending down) solved for the longest window within the budget. "
          "Where the child reports its training phase's peak apart from its load's (VmHWM reset once the model is "
          "built: transformers' init of a preset from its config peaks above what a short window's training holds), "
          "the line goes through the training peaks and the load's peak must fit the budget too. "
          "The same model and float32 weights (transformers dequantizes a GGUF as it loads it: remat.models.load "
          "with as_stored=False; a plan-only preset built by transformers from its config), PEFT LoRA with remat's "
          "default adapter (r 8, every decoder linear layer) or every weight, `gradient_checkpointing_enable()` "
          "(non-reentrant), the model's own loss (`labels=`), AdamW. remat: `remat finetune --path walk --recompute "
          "on --dtype float32` (the exact walk: the whole window's gradient; the graph holds one chunk, only the K/V "
          "cache and its gradient grow with the window) on float32 weights (the embedded GGUF dequantized by gguf-py "
          "into a float32 GGUF: Hugging Face's values) and, with LoRA, on the weights as the GGUF stores them (the "
          "embedded Q4_1 blocks; the preset planned at the Q4_K_M mix, `--weights q4_k_m`), one step at the same "
          "short windows measured the same way; its curve is its plans (`remat plan`, same settings, windows up to "
          "the model's maximum context) moved up by what those runs held beyond their plans (runtime, trace, "
          "allocator: the median gap), solved on that broken line. Its growth per token (the cache, about 0.1 MiB a "
          "token on SmolLM2) is below the noise of a peak measured at short windows: the plans give the slope, the "
          "runs the level. qwen2.5-coder-1.5b is a plan-only preset in remat (`remat finetune` does not build it): "
          "its remat rows are plans plus the gap measured on SmolLM2 (the same side), marked \"plan only\". "
          "\"confirmed\": one step run at the window found, its peak within the budget (a run over the budget it "
          "was run for joins the fit, and the window the fit then gives is run again; a side's window is never "
          "below one a run held within the budget); \"fit only\": no run there (longer than this machine has). "
          "Weights do not fit: the frozen weights (LoRA: float32, or the blocks' bytes) or weights + grads + AdamW's "
          "two moments (full, 4 × 4 bytes a weight) alone exceed the budget. "
          "Capped: the window found is past the model's maximum context (`max_position_embeddings`).")


def report(cases: Sequence[Any], runs: list[dict], budgets: Sequence[int], target: float, machine: str,
           out: Path) -> dict:
    res: dict[str, Any] = {"budgets_gib": list(budgets), "target": target, "machine": machine, "method": METHOD,
                           "rows": rows(cases, runs, budgets, target), "runs": runs}
    res["markdown"] = markdown(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({k: v for k, v in res.items() if k != "markdown"}, indent=1) + "\n")
    (out / "bench.md").write_text(res["markdown"])
    plot(cases, res, out / "bench.png")
    return res


def _curve(runs: list[dict], case: Any, side: str, mode: str) -> list[tuple[float, float]]:
    """What the report solves on, to draw: remat's anchored plans, Hugging Face's fit."""
    points, top = _points(runs, case.label, side, mode), max_context(case.spec)
    if side != "hf":
        curve = anchored(_plans(runs, case.label, side, mode), points, borrowed_offset(runs, side, mode)) or []
        return [(float(n), p) for n, p in curve]
    coef = fit(points)
    return [] if coef is None else [(top * i / 100, predict(coef, top * i / 100)) for i in range(101)]


def plot(cases: Sequence[Any], res: dict, dest: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    panels = [(c, m) for c in cases for m in ("lora", "full") if _points(runs, c.label, "hf", m)]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5.5 * max(len(panels), 1), 4.2), squeeze=False)
    for ax, (case, mode) in zip(axes[0], panels):
        for side in sides(mode):
            colour = {"remat": "tab:blue", "blocks": "tab:green", "hf": "tab:orange"}[side]
            curve = _curve(runs, case, side, mode)
            ax.plot([n for n, _ in curve], [p / GiB for _, p in curve], color=colour, lw=1,
                    label=SIDE_NAMES[side] + (": fit" if side == "hf" else ": plans + measured gap"))
            pts = _points(runs, case.label, side, mode)
            ax.scatter([n for n, _ in pts], [p / GiB for _, p in pts], color=colour, s=18)
        for gib in res["budgets_gib"]:
            ax.axhline(gib, color="grey", lw=0.6, ls="--")
        ax.set_xlim(0, max_context(case.spec))
        ax.set_ylim(0, max(res["budgets_gib"]) * 1.3)
        ax.set_title(f"{case.label}, {'LoRA r8' if mode == 'lora' else 'full'}", fontsize=9)
        ax.set_xlabel("window (tokens)")
        ax.set_ylabel("peak RSS, GiB (dots: measured runs)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
