"""`remat plan`'s wall time and peak RSS, before and after: two checkouts, one fresh process per run, interleaved.

    python -m remat.bench.plan_time                       # before = --before 8c470fb, the last commit before stamping
    python -m remat.bench.plan_time --same-plan-as 670cfb6  # plans that changed on purpose since before: equal to these
    python -m remat.bench.plan_time --rounds 1 --limit 120 --out /tmp/plan-time

"before" and "after" are git worktrees of `--before` and `--after` (default HEAD) made in a temporary
folder, run with this checkout's environment (PYTHONPATH puts their `src` first). For each case the two run
in turn (before, after, before, after, ...) so that a shared machine's drift hits both. A run is
`python -m remat plan ... --json` (both plans, off and on): its wall time from start to exit, its peak
RSS from the kernel (`wait4`'s ru_maxrss), and its plans, compared between the checkouts (the plan
must not change when it gets faster; where commits between them changed plans on purpose,
`--same-plan-as` names a later one to compare with, run once per case, untimed). A run over
`--limit` seconds is killed and reported as such; that checkout's later rounds of the case are skipped.
Both use one REMAT_CACHE_DIR; a first run of each on the GGUF, cache cold, is reported apart (`cold_s`):
after keeps the GGUF's config there, so only its first plan of a GGUF file pays a parse of it.
Writes results.json, results.md and results.png into --out (default bench/results/plan_time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout: bench/results is written there
CASES = [  # (label, remat plan arguments): the settings the issue measured
    ("SmolLM2-135M GGUF, ctx 2048", ["--ctx", "2048"]),
    ("qwen2.5-coder-1.5b, ctx 34816", ["--model", "qwen2.5-coder-1.5b", "--ctx", "34816"]),
    ("qwen3.5-0.8b, ctx 512", ["--model", "qwen3.5-0.8b", "--ctx", "512"]),
    ("qwen3.5-0.8b, ctx 4096", ["--model", "qwen3.5-0.8b", "--ctx", "4096"]),
    ("qwen3.5-0.8b, ctx 34816", ["--model", "qwen3.5-0.8b", "--ctx", "34816"]),
]
TARGET_S = 10.0  # each case, here
MiB = 1 << 20


def run_plan(src: Path, args: list[str], env: dict, limit: float, key: str = "plans") -> dict:
    """One `remat plan` process: its seconds, peak RSS (MiB) and plans (its JSON's `key`), or timed_out past
    `limit`."""
    with tempfile.TemporaryFile() as out:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "remat", "plan", *args, "--json"], cwd=ROOT,
                                env=env | {"PYTHONPATH": str(src / "src")}, stdout=out,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        while True:  # reaped here, not by Popen, so that its own rusage (peak RSS) is ours to read
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            seconds = time.monotonic() - start
            if pid:
                break
            if seconds > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                os.wait4(proc.pid, 0)
                proc.returncode = -signal.SIGKILL
                return {"timed_out": True, "seconds": None, "peak_rss_mib": None, "plans": None}
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"plan_time: `remat plan {' '.join(args)}` from {src} exited {proc.returncode}")
        out.seek(0)
        plans = json.loads(out.read())[key]
    return {"timed_out": False, "seconds": round(seconds, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "plans": plans}


def worktree(rev: str, dest: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(dest), rev], check=True)
    return dest


def remove_worktree(src: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], check=False)


def measure(checkouts: dict[str, Path], args: list[str], env: dict, rounds: int, limit: float,
            key: str = "plans") -> tuple[dict, dict]:
    """Each checkout's runs of one case, interleaved (a checkout that timed out is not run again), and the
    plans of each that finished."""
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(rounds):
        for name, src in checkouts.items():
            if not any(r["timed_out"] for r in runs[name]):
                runs[name].append(run_plan(src, args, env, limit, key))
                print(f"  {name}: {runs[name][-1]['seconds']} s", file=sys.stderr)
    result: dict = {}
    for name, rs in runs.items():
        done = [r for r in rs if not r["timed_out"]]
        result[name] = {"runs": len(rs), "timed_out": len(done) < len(rs),
                        "seconds": statistics.median(r["seconds"] for r in done) if done else None,
                        "seconds_each": [r["seconds"] for r in done],
                        "peak_rss_mib": max((r["peak_rss_mib"] for r in done), default=None)}
    plans = {name: rs[0]["plans"] for name, rs in runs.items() if rs and not rs[0]["timed_out"]}
    return result, plans


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="8c470fb", help="the commit to compare with (default: before stamping)")
    p.add_argument("--after", default="HEAD", help="the commit measured against it (default: HEAD)")
    p.add_argument("--same-plan-as", help="the commit whose plans after's must equal, byte for byte, one untimed "
                   "run per case (default: before; give one where the plans changed on purpose since before)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--limit", type=float, default=240.0, help="seconds a run may take before it is killed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_time"))
    args = p.parse_args(argv)
    started = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="remat-plan-time-") as tmp:
        checkouts = {side: worktree(rev, Path(tmp) / side) for side, rev in (("before", args.before),
                                                                               ("after", args.after))}
        reference = worktree(args.same_plan_as, Path(tmp) / "reference") if args.same_plan_as else None
        env = {**os.environ, "REMAT_CACHE_DIR": str(Path(tmp) / "cache")}
        try:
            cold = {name: run_plan(src, CASES[0][1], env, args.limit)["seconds"] for name, src in checkouts.items()}
            cases = []
            for label, plan_args in CASES:
                print(f"== {label}", file=sys.stderr)
                result, plans = measure(checkouts, plan_args, env, args.rounds, args.limit)
                if reference is not None:
                    plans["before"] = run_plan(reference, plan_args, env, args.limit)["plans"]
                same = plans.get("before") is not None and plans.get("after") is not None
                cases.append({"case": label, "args": plan_args, **result,
                              "same_plan": plans["before"] == plans["after"] if same else None})
        finally:
            for src in [*checkouts.values(), *([reference] if reference else [])]:
                remove_worktree(src)
    after_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.after], capture_output=True,
                               text=True, check=True).stdout.strip()
    res = {"before": args.before, "after": after_rev, "same_plan_as": args.same_plan_as or args.before,
           "rounds": args.rounds, "limit_s": args.limit,
           "target_s": TARGET_S, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "elapsed_s": round(time.monotonic() - started, 1), "cold_s": cold, "cases": cases}
    write_results(Path(args.out), res, markdown, plot)
    return 0


def write_results(out: Path, res: dict, markdown: Callable[[dict], str], plot: Callable[[dict, Path], None]) -> None:
    """A bench's results.json, results.md and results.png into `out`; the Markdown is printed too."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(markdown(res))
    plot(res, out / "results.png")
    print(markdown(res))


def seconds_text(side: dict, limit: float) -> str:
    return f"over {limit:.0f}" if side["timed_out"] else f"{side['seconds']:.1f}"


def _cold(res: dict, side: str) -> str:
    s = res["cold_s"][side]
    return f"over {res['limit_s']:.0f}" if s is None else f"{s:.1f}"


def markdown(res: dict) -> str:
    limit = res["limit_s"]
    lines = [f"# `remat plan`: before ({res['before']}) and after ({res['after']})", "",
             "| case | before s | after s | before / after | before peak RSS MiB | after peak RSS MiB "
             f"| same plan as {res['same_plan_as']} | after under 10 s |", "|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
        b, a = c["before"], c["after"]
        ratio = f"{b['seconds'] / a['seconds']:.2f}" if b["seconds"] and a["seconds"] else "n/a"
        lines.append(f"| {c['case']} | {seconds_text(b, limit)} | {seconds_text(a, limit)} | {ratio} "
                     f"| {b['peak_rss_mib'] or 'n/a'} | {a['peak_rss_mib'] or 'n/a'} "
                     f"| {'n/a' if c['same_plan'] is None else 'yes' if c['same_plan'] else 'NO'} "
                     f"| {'yes' if a['seconds'] and a['seconds'] < res['target_s'] else 'no'} |")
    q512 = next(c for c in res["cases"] if c["case"].endswith("ctx 512"))["after"]["seconds"]
    q34k = next(c for c in res["cases"] if c["case"].startswith("qwen3.5") and c["case"].endswith("34816"))["after"]
    lines += ["", "qwen3.5-0.8b at 34,816 within 1.5x of its time at 512: "
              + ("no (over the limit)" if q34k["timed_out"] else f"{q34k['seconds'] / q512:.2f}x"), "",
              f"Medians of {res['rounds']} runs per checkout, interleaved (before, after, ...); each run is a fresh "
              f"`python -m remat plan ... --json` process, imports included. A run over {limit:.0f} s was killed "
              "(and not repeated). Peak RSS: the process's maximum resident set (`wait4`). Same plan: after's "
              f"plans (off and on) equal {res['same_plan_as']}'s, byte for byte. The first plan of the GGUF file, "
              f"cache cold: before {_cold(res, 'before')} s, after {_cold(res, 'after')} s (after keeps the "
              "config it parses, so later plans read it back). "
              f"{res['machine']}; load average {res['loadavg_start']} at the start, {res['loadavg_end']} "
              f"at the end; {res['elapsed_s']:.0f} s in all."]
    return "\n".join(lines) + "\n"


def plot(res: dict, dest: Path, xlabel: str = "remat plan wall time, s (a fresh process, imports included)") -> None:
    limit = res["limit_s"]
    cases = res["cases"]
    chart(dest, [c["case"] for c in cases],
          {side: [c[side]["seconds"] or limit for c in cases] for side in ("before", "after")},
          texts={side: [seconds_text(c[side], limit) for c in cases] for side in ("before", "after")},
          target=res["target_s"], target_label=f"target {res['target_s']:.0f} s",
          xlabel=xlabel, height=4.2)


def chart(dest: Path, labels: list[str], seconds: dict[str, list[float]], *, target: float, target_label: str,
          xlabel: str, height: float, texts: dict[str, list[str]] | None = None, legend: dict[str, str] | None = None,
          fontsize: int = 8, xmax: float | None = None) -> None:
    """Before and after, a pair of bars per label, and the target: a bench's results.png (none without
    matplotlib). `xmax`: room on the right for the legend."""
    try:
        import matplotlib
    except ImportError:
        print(f"{Path(sys.argv[0]).stem}: matplotlib is not installed: no {dest.name}", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, height), dpi=120)
    for k, (side, color) in enumerate((("before", "tab:gray"), ("after", "tab:green"))):
        bars = ax.barh([i + 0.4 * k for i in range(len(labels))], seconds[side], height=0.38, color=color,
                       label=(legend or {}).get(side, side))
        for bar, text in zip(bars, (texts or {}).get(side, []), strict=False):
            ax.annotate(text, (bar.get_width(), bar.get_y() + 0.19), xytext=(3, -3), textcoords="offset points",
                        fontsize=8)
    ax.axvline(target, color="tab:red", linestyle="--", label=target_label)
    ax.set_yticks([i + 0.2 for i in range(len(labels))], labels, fontsize=fontsize)
    ax.invert_yaxis()
    if xmax is not None:
        ax.set_xlim(0, xmax)
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(dest, format="png")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
