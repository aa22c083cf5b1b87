"""How long `remat finetune` takes to show its plan, and to reach its traced gate, before and after: two
checkouts, one fresh process per run, interleaved.

    python -m remat.bench.first_plan --before 31a3f61 --out bench/results/first_plan

A run is `python -m remat finetune` on the default model (SmolLM2-135M GGUF, LoRA, its corpus), its stderr read
line by line: `first_s` is when the first plan table starts (after: the one from the model's config, before
its weights load; before: the traced gate's), `traced_s` when the table with the measured `trace` starts (the
gate on the real, traced model, just before the first step). The run is killed there: nothing trains. Both
checkouts use one REMAT_CACHE_DIR, the GGUF converted once before the timed runs. Writes results.json,
results.md and results.png into --out (default bench/results/first_plan).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remat.bench.plan_time import chart, worktree, write_results

ROOT = Path(__file__).resolve().parents[3]  # the checkout: bench/results is written there
TARGET_S = 10.0  # the plan on screen within this many seconds of the start, here


def run_finetune(src: Path, out: Path, env: dict, limit: float) -> dict:
    """One `remat finetune`: seconds to its first plan table and to its traced one (the `trace` row not 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "remat", "finetune", "--out", str(out)], cwd=ROOT,
                            env=env | {"PYTHONPATH": str(src / "src")}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    start, first, traced = time.monotonic(), None, None
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            now = time.monotonic() - start
            if line.startswith("MiB ") and first is None:
                first = round(now, 2)
            words = line.split()
            if words[:1] == ["trace"] and any(w != "0.0" for w in words[1:]):
                traced = round(now, 2)
                break
            if now > limit:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if traced is None:
        raise SystemExit(f"first_plan: `remat finetune` from {src} showed no traced plan within {limit:.0f} s")
    return {"first_s": first, "traced_s": traced}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the commit to compare with")
    p.add_argument("--after", default="HEAD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--limit", type=float, default=300.0, help="seconds a run may take to reach its traced plan")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "first_plan"))
    args = p.parse_args(argv)
    started, load_start = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="remat-first-plan-") as tmp:
        checkouts = {side: worktree(rev, Path(tmp) / side) for side, rev in (("before", args.before),
                                                                               ("after", args.after))}
        env = {**os.environ, "REMAT_CACHE_DIR": str(Path(tmp) / "cache")}
        try:
            run_finetune(checkouts["after"], Path(tmp) / "warm", env, args.limit)  # converts the GGUF, untimed
            runs: dict[str, list[dict]] = {side: [] for side in checkouts}
            for r in range(args.rounds):
                for side, src in checkouts.items():
                    runs[side].append(run_finetune(src, Path(tmp) / f"{side}{r}", env, args.limit))
                    print(f"  {side}: {runs[side][-1]}", file=sys.stderr)
        finally:
            for src in checkouts.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], check=False)
    after_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.after], capture_output=True,
                               text=True, check=True).stdout.strip()
    res = {"before": args.before, "after": after_rev, "rounds": args.rounds, "target_s": TARGET_S,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "loadavg_start": load_start,
           "loadavg_end": [round(x, 2) for x in os.getloadavg()], "elapsed_s": round(time.monotonic() - started, 1),
           "runs": runs,
           "median": {side: {k: statistics.median(r[k] for r in rs) for k in ("first_s", "traced_s")}
                      for side, rs in runs.items()}}
    write_results(Path(args.out), res, markdown, plot)
    return 0


def plot(res: dict, dest: Path) -> None:
    m = res["median"]
    chart(dest, ["first plan on screen", "traced gate (first step next)"],
          {side: [m[side]["first_s"], m[side]["traced_s"]] for side in ("before", "after")},
          texts={side: [f"{m[side]['first_s']:.1f}", f"{m[side]['traced_s']:.1f}"] for side in ("before", "after")},
          target=TARGET_S, target_label=f"target {TARGET_S:.0f} s (the plan on screen)",
          xlabel="seconds from `remat finetune`'s start (SmolLM2-135M GGUF, LoRA)", height=2.6,
          xmax=2.1 * max(m[side]["traced_s"] for side in m))


def markdown(res: dict) -> str:
    m = res["median"]
    b, a = m["before"], m["after"]
    return "\n".join([
        f"# `remat finetune`: its plan on screen, before ({res['before']}) and after ({res['after']})", "",
        "| event | before s | after s | before / after |", "|---|---|---|---|",
        f"| first plan on screen | {b['first_s']:.1f} | {a['first_s']:.1f} | {b['first_s'] / a['first_s']:.2f} |",
        f"| traced gate (the first step next) | {b['traced_s']:.1f} | {a['traced_s']:.1f} "
        f"| {b['traced_s'] / a['traced_s']:.2f} |", "",
        f"Medians of {res['rounds']} runs per checkout, interleaved (before, after, ...); each run a fresh "
        "`python -m remat finetune` (the default model, LoRA, its corpus), imports included, killed once its "
        "traced plan is on screen. Before, the first plan is the traced gate's; after, the plan from the "
        "model's config comes first, before the weights load, and the traced gate follows. "
        f"{res['machine']}; load average {res['loadavg_start']} at the start, {res['loadavg_end']} at the end; "
        f"{res['elapsed_s']:.0f} s in all.",
    ]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
