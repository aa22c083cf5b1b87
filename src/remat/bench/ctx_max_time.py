"""`remat plan --ctx max`'s wall time and peak RSS, before and after (`plan_time`'s way: two checkouts, a fresh
process per run, interleaved), and the windows each names (the same, where only the time changed).

    python -m remat.bench.ctx_max_time --before 8adb193

Writes results.json, results.md and results.png into --out (default bench/results/ctx_max_time).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from remat.bench import plan_time
from remat.bench.plan_time import ROOT, measure, run_plan, seconds_text, worktree, write_results

CASES = [  # (label, remat plan --ctx max arguments): the jobs the longest-window issue timed
    ("SmolLM2-135M GGUF, 400 MiB", ["--memory-budget", "400MiB"]),
    ("qwen3.5-0.8b, 4 GiB", ["--model", "qwen3.5-0.8b", "--memory-budget", "4GiB"]),
    ("qwen3.5-0.8b, 8 GiB", ["--model", "qwen3.5-0.8b", "--memory-budget", "8GiB"]),
    ("qwen2.5-coder-1.5b, 8 GiB", ["--model", "qwen2.5-coder-1.5b", "--memory-budget", "8GiB"]),
    ("smollm2-135m, 640 MiB (a window of ~100 tokens)", ["--model", "smollm2-135m", "--memory-budget", "640MiB"]),
]
TARGET_S = 15.0
XLABEL = "remat plan --ctx max wall time, s (a fresh process, imports included)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="8adb193", help="the commit to compare with")
    p.add_argument("--after", default="HEAD", help="the commit measured against it (default: HEAD)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--limit", type=float, default=120.0, help="seconds a run may take before it is killed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "ctx_max_time"))
    args = p.parse_args(argv)
    started, load_start = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="remat-ctx-max-time-") as tmp:
        checkouts = {side: worktree(rev, Path(tmp) / side) for side, rev in (("before", args.before),
                                                                               ("after", args.after))}
        env = {**os.environ, "REMAT_CACHE_DIR": str(Path(tmp) / "cache")}
        try:
            run_plan(checkouts["after"], ["--ctx", "max", *CASES[0][1]], env, args.limit, "paths")  # the GGUF's
            cases = []  # config parsed into the shared cache once, untimed
            for label, plan_args in CASES:
                result, paths = measure(checkouts, ["--ctx", "max", *plan_args], env, args.rounds, args.limit,
                                        "paths")
                named = {side: {k: [a["ctx"], a["policy"], a["probes"]] for k, a in ps.items()}
                         for side, ps in paths.items()}
                same = [{k: v[:2] for k, v in named.get(side, {}).items()} for side in ("before", "after")]
                cases.append({"case": label, "args": plan_args, **result, "paths": named,
                              "same_windows": same[0] == same[1] if len(named) == 2 else None})
        finally:
            for src in checkouts.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], check=False)
    after_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.after], capture_output=True,
                               text=True, check=True).stdout.strip()
    res = {"before": args.before, "after": after_rev, "rounds": args.rounds, "limit_s": args.limit,
           "target_s": TARGET_S, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "elapsed_s": round(time.monotonic() - started, 1), "cases": cases}
    write_results(Path(args.out), res, markdown, functools.partial(plan_time.plot, xlabel=XLABEL))
    return 0


def _windows(paths: dict | None) -> str:
    """`window 4,672 (every:4, 4 probes); walk 8,704 (...)`."""
    if not paths:
        return "n/a"
    return "; ".join(f"{k} {'none' if c is None else f'{c:,}'} ({pol}, {n} probes)" for k, (c, pol, n) in paths.items())


def markdown(res: dict) -> str:
    limit, target = res["limit_s"], res["target_s"]
    lines = [f"# `remat plan --ctx max`: before ({res['before']}) and after ({res['after']})", "",
             "| job | before s | after s | before / after | before peak RSS MiB | after peak RSS MiB | windows "
             f"(after) | windows as before | after within {target:.0f} s |", "|---|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
        b, a = c["before"], c["after"]
        ratio = f"{b['seconds'] / a['seconds']:.2f}" if b["seconds"] and a["seconds"] else "n/a"
        same = "n/a" if c["same_windows"] is None else "yes" if c["same_windows"] else "NO"
        lines.append(f"| {c['case']} | {seconds_text(b, limit)} | {seconds_text(a, limit)} | {ratio} "
                     f"| {b['peak_rss_mib'] or 'n/a'} | {a['peak_rss_mib'] or 'n/a'} "
                     f"| {_windows(c['paths'].get('after'))} | {same} "
                     f"| {'yes' if a['seconds'] and a['seconds'] <= target else 'no'} |")
    lines += ["", f"Medians of {res['rounds']} runs per checkout, interleaved (before, after, ...); each run is a "
              "fresh `python -m remat plan --ctx max ... --json` process, imports included, both paths (the window; "
              f"the walk, in a forked child). A run over {limit:.0f} s was killed (and not repeated). Peak RSS: the "
              "parent process's maximum resident set (`wait4`). Windows as before: each path's window and policy "
              f"equal before's. {res['machine']}; load average {res['loadavg_start']} at the start, "
              f"{res['loadavg_end']} at the end; {res['elapsed_s']:.0f} s in all."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
