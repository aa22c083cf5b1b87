"""The longest training window in 4, 8 and 16 GiB: remat against Hugging Face + PEFT with gradient checkpointing.

    python -m remat.bench.longest_window                       # measure what is missing, then report
    python -m remat.bench.longest_window --report-only         # the report from bench/results/longest_window/runs.json

Hugging Face + PEFT's window is found from measured runs: one step at each of a few short windows
(`peers.measured`: a child process, its peak resident set; float32 weights, as transformers loads a GGUF), a line
(a parabola from three windows on) fitted through the peaks and solved for the budget. remat's side, its path for
long windows (the exact walk, chunks of `Case.ubatch` tokens over the window's K/V cache, recompute on), runs at the
same short windows, measured the same way, twice with LoRA: on float32 weights (side `remat`: the same weights as
Hugging Face's) and on the weights as the GGUF stores them (side `blocks`; a preset planned at `Case.mix`). Its
curve is its plans (`remat plan`, no weights) up to the model's maximum context, moved by what those runs held
beyond their plans (see `longest_report`). A confirming run at the found
window runs where this machine can run it (`Case.confirm_max`, not `--no-confirm`); elsewhere the row says "fit
only". Rows the model's maximum context caps say so; where the weights (and, with full fine-tuning, the grads and
AdamW's two moments) alone exceed the budget, the row says that instead of a number. Every run and plan is kept in
runs.json; a rerun measures only what is missing or failed (`--fresh`: everything again).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.bench import llama_cpp, peers
from remat.bench.longest_report import report, sides

GiB = 1 << 30
BUDGETS = (4, 8, 16)  # GiB
TARGET = 2.0  # remat's window at least twice Hugging Face + PEFT's where neither is capped
CONFIRM_ROUNDS = 3  # confirming runs, then again where their peaks moved a fit to another window


@dataclass(frozen=True)
class Case:
    label: str
    spec: str | None  # remat.models.load's spec: None = the embedded SmolLM2 GGUF
    windows: tuple[int, ...]  # the short windows measured for the fit
    ubatch: int  # remat's walk chunk
    confirm_max: int  # the longest window a confirming run is tried at on this machine
    plan_windows: tuple[int, ...]  # remat's plans: its curve between and past the measured windows
    remat_trains: bool = True  # False: a plan-only preset to remat (`remat finetune` refuses it): plans alone
    mix: str | None = None  # the blocks side's GGUF type mix (`--weights`), for a preset; None: the file's own


CASES = (
    Case("SmolLM2-135M (embedded GGUF)", None, (256, 512), 256, 8192,
         (256, 1024, 2048, 4096, 8192)),
    Case("qwen2.5-coder-1.5b (preset)", "qwen2.5-coder-1.5b", (64, 128), 64, 128,
         (64, 128, 1024, 4096, 8192, 16384, 32768), remat_trains=False, mix="q4_k_m"),
)
MODES = ("lora", "full")
OUT = peers.ROOT / "bench" / "results" / "longest_window"


def run_key(r: dict) -> tuple:
    return r["model"], r["side"], r["mode"], r["ctx"], r["purpose"]


def remat_model(case: Case, side: str) -> tuple[str | None, str | None]:
    """remat's model and `--weights` for `side`: as stored (`blocks`), or float32 (a GGUF's float32 copy; a preset
    is float32 already)."""
    if side == "blocks":
        return case.spec, case.mix
    if case.spec is None:
        return str(llama_cpp.default_float32_gguf()), None
    return case.spec, None


def side_cmd(case: Case, side: str, mode: str, ctx: int, data: Path) -> list[str]:
    lora = mode == "lora"
    if side == "hf":
        return peers.hf_cmd(case.spec, ctx, lora=lora, steps=1)
    extra = ("--path", "walk", "--ubatch", str(min(case.ubatch, ctx)), "--recompute", "on")
    return peers.remat_cmd(remat_model(case, side)[0], ctx, lora=lora, steps=1, data=data, extra=extra)


def measure(case: Case, side: str, mode: str, ctx: int, purpose: str, data: Path, timeout: float) -> dict:
    """One step of `side` at `ctx` in a child process: its peak resident set, wall time and what it said."""
    r = peers.measured(side_cmd(case, side, mode, ctx, data), timeout=timeout)
    said = r.json()
    keep = {k: said.get(k) for k in ("policy", "tokens_per_second", "process_peak", "trainable_parameters",
                                     "frozen_parameters", "attention", "dtype", "losses", "load_peak_rss",
                                     "train_peak_rss") if k in said}
    if "plan" in said:
        keep["planned_total"] = said["plan"]["total"]
    row = {"model": case.label, "side": side, "mode": mode, "ctx": ctx, "purpose": purpose, "rc": r.rc,
           "peak_rss": r.peak_rss if r.rc == 0 else None, "seconds": round(r.seconds, 1), **keep}
    if r.rc != 0:
        row["error"] = r.error()
    return row


def plan(case: Case, side: str, mode: str, ctx: int) -> dict:
    """remat's plan of `side` at `ctx` (`remat plan --path walk --recompute on`: from the file's header or the
    preset's config, no weights)."""
    import time

    from remat.base.settings import TrainSettings
    from remat.training import gate

    t0 = time.perf_counter()
    model, weights = remat_model(case, side)
    s = TrainSettings(model=model, weights=weights, ctx=ctx, lora=mode == "lora", path="walk",
                      ubatch=min(case.ubatch, ctx), recompute="on", dtype="float32")
    planned = gate.admit(s, gate.Budget.unlimited(), world_size=1, planners=_planners(model)).plans["on"]
    return {"model": case.label, "side": side, "mode": mode, "ctx": ctx, "purpose": "plan", "rc": 0,
            "peak_rss": None, "seconds": round(time.perf_counter() - t0, 1),
            "planned_total": planned.total, "planned_frozen": planned.frozen}


@functools.cache
def _planners(spec: str | None) -> Any:
    from remat.models import load as models
    from remat.training import gate
    return gate.Planners(models.load_config(spec))


def load_runs(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"] if path.exists() else []


def save_runs(path: Path, runs: list[dict], machine: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "runs": runs}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remat.bench.longest_window", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--report-only", action="store_true", help="no runs: the report from runs.json")
    p.add_argument("--fresh", action="store_true", help="measure every run again")
    p.add_argument("--no-confirm", action="store_true", help="fit only: no run at the found windows")
    p.add_argument("--plans-only", action="store_true", help="remat's plans only, no training runs")
    p.add_argument("--only", default=None, help="the cases whose label contains this")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    a = p.parse_args(argv)
    path = a.out / "runs.json"
    runs = [] if a.fresh else load_runs(path)
    machine = json.loads(path.read_text())["machine"] if a.report_only and path.exists() else peers.machine()
    if not a.report_only:
        cases = [c for c in CASES if a.only is None or a.only in c.label]
        runs = _measure_all(cases, runs, path, machine, a.timeout, confirm=not a.no_confirm, train=not a.plans_only)
    res = report(CASES, runs, BUDGETS, TARGET, machine, a.out)
    print(res["markdown"])
    return 0


def _measure_all(cases: list[Case], runs: list[dict], path: Path, machine: str, timeout: float, *,
                 confirm: bool, train: bool = True) -> list[dict]:
    """The fit's runs that runs.json lacks, then the confirming runs the fits ask for; saved after each."""
    from remat.bench.longest_report import confirmations

    data = peers.text_file(path.parent / ".text.txt")
    runs[:] = [r for r in runs if r.get("rc") == 0]  # a failed run is tried again
    done = {run_key(r) for r in runs}

    def one(case: Case, side: str, mode: str, ctx: int, purpose: str, budget_gib: int | None = None) -> None:
        if (case.label, side, mode, ctx, purpose) in done:
            return
        print(f"longest_window: {case.label} {side} {mode} ctx {ctx} ({purpose})", file=sys.stderr, flush=True)
        runs.append(plan(case, side, mode, ctx) if purpose == "plan" else
                    measure(case, side, mode, ctx, purpose, data, timeout))
        if budget_gib is not None:  # the budget a confirming run is for: over it, its peak moves the fit
            runs[-1]["budget"] = budget_gib * GiB
        done.add(run_key(runs[-1]))
        save_runs(path, runs, machine)
        print(f"  -> {runs[-1]}", file=sys.stderr, flush=True)

    for mode in MODES:
        for case in cases:
            if mode == "full" and not _fits_at_all(case, BUDGETS[-1]):
                continue  # the weights and the optimizer's state alone exceed the largest budget
            for side in (side for side in sides(mode) if side != "hf"):  # remat's sides plan
                for ctx in case.plan_windows:
                    one(case, side, mode, ctx, "plan")
            for ctx in case.windows if train else ():
                for side in sides(mode) if case.remat_trains else ("hf",):
                    one(case, side, mode, ctx, "fit")
    for _ in range(CONFIRM_ROUNDS if confirm and train else 0):  # each round's peaks move the fits: again
        wanted = [w for w in confirmations(cases, runs, BUDGETS) if (w[0].label, *w[1:4], "confirm") not in done]
        for case, side, mode, ctx, gib in wanted:
            one(case, side, mode, ctx, "confirm", gib)
        if not wanted:
            break
    return runs


def _fits_at_all(case: Case, budget_gib: int) -> bool:
    from remat.bench.longest_report import floor_bytes, parameter_count
    n = parameter_count(case.spec)
    return min(floor_bytes(n, side, "full") for side in sides("full")) < budget_gib * GiB


if __name__ == "__main__":
    sys.exit(main())
