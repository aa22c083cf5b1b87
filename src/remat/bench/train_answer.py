"""How long `remat serve` takes to answer a training job of a new shape, before and after: two servers, interleaved.

    python -m remat.bench.train_answer                    # before = --before 9c922f9, ~3 min
    python -m remat.bench.train_answer --before HEAD~3 --out /tmp/train-answer

The gate's answer (plans, policy, or a refusal with figures) comes before any training, so every `POST /train`
of a shape not planned yet traces and plans it first. This starts one real server (`python -m remat serve`,
the embedded SmolLM2-135M) from a git worktree of `--before` and one from `--after` (default HEAD), both
running at once, idle but for this, and waits `--settle` seconds once both are up. Then it asks each for
`POST /train/plan` (what `POST /train` answers, less the queued job: the same validation, plan and gate) in
turn, the order alternating from one request to the next: first a job of the server's defaults (what the
web page sends), then a new window size for both each time, LoRA (the server's default) and full
fine-tuning, then LoRA with a budget between the on and off plans (the gate searches what to save back),
then shapes asked before (a server keeps its plans by shape).
A request's seconds are the client's, from sending to the whole answer read. Both answers are 200 with the
same plans, policy and steps (the budget is the free memory of the moment). Writes results.json,
results.md and results.png into --out (default bench/results/train_answer).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serve_slowdown import CONCURRENCY, Client, corpus_records, start_server

from remat.bench.plan_time import chart, worktree, write_results

ROOT = Path(__file__).resolve().parents[3]  # the checkout: bench/results is written there
NEW_LORA = [320, 384, 448, 512, 640, 768, 1024, 1536, 2048]  # ctx: each new to the server when asked
NEW_FULL = [288, 576, 1152]
REPEATED = [256, 512, 2048]  # asked again, LoRA
NEW_TIGHT = [264, 272, 280]  # LoRA, each new, with a budget between its on and off plans: a save-back search
BETWEEN = "between"  # the budget halfway between the on and off plans of the first job (ctx 256, LoRA)
TARGET_S = 1.0  # "about a second"


def requests() -> list[tuple[str, dict]]:
    """(kind, the request's settings besides data), in the order asked."""
    return ([("the server's default job, first asked", {})]  # ctx 256, LoRA: the web page's
            + [("new shape, LoRA", {"ctx": c}) for c in NEW_LORA]
            + [("new shape, full", {"ctx": c, "lora": False}) for c in NEW_FULL]
            + [("new shape, LoRA, a budget between on and off", {"ctx": c, "memory_budget": BETWEEN})
               for c in NEW_TIGHT]
            + [("repeated shape, LoRA", {"ctx": c}) for c in REPEATED])


def ask(client: Client, body: dict) -> tuple[float, int, Any]:
    start = time.monotonic()
    status, answer = client.request("POST", "/train/plan", body)
    return round(time.monotonic() - start, 3), status, answer


def measure(clients: dict[str, Client], records: list[dict]) -> list[dict]:
    rows, between = [], None
    for i, (kind, asked) in enumerate(requests()):
        settings = {**asked, "memory_budget": between} if asked.get("memory_budget") == BETWEEN else asked
        order = list(clients) if i % 2 == 0 else list(reversed(clients))
        answers = {side: ask(clients[side], {"data": records, **settings}) for side in order}
        for side, (_, status, answer) in answers.items():
            if status != 200:
                raise SystemExit(f"train_answer: {side} answered {status} to {settings}: {answer}")
        if between is None:  # the first job's plans: a few tokens longer, on still fits and off does not
            plans = answers["after"][2]["plans"]
            between = (plans["on"]["total"] + plans["off"]["total"]) // 2
        same = all(answers["before"][2][k] == answers["after"][2][k] for k in ("plans", "policy", "steps"))
        rows.append({"kind": kind, **settings, "first": order[0], "same_answer": same,
                     **{side: answers[side][0] for side in clients}})
        print(f"  {kind} {settings}: before {rows[-1]['before']} s, after {rows[-1]['after']} s", file=sys.stderr)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        of = [r for r in rows if r["kind"] == kind]
        out[kind] = {side: {"median_s": statistics.median(r[side] for r in of), "max_s": max(r[side] for r in of)}
                     for side in ("before", "after")}
        out[kind]["ratio"] = round(out[kind]["before"]["median_s"] / out[kind]["after"]["median_s"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="9c922f9", help="the commit to compare with (default: before this bench)")
    p.add_argument("--after", default="HEAD")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to wait once both servers are up")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_answer"))
    args = p.parse_args(argv)
    started, load_start = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    server_args = argparse.Namespace(model=None, max_slowdown_ppm=50_000, threads=os.cpu_count())
    records = corpus_records(8)
    with tempfile.TemporaryDirectory(prefix="remat-train-answer-") as tmp:
        tmp_path = Path(tmp)
        checkouts = {side: worktree(rev, tmp_path / side) for side, rev in (("before", args.before),
                                                                             ("after", args.after))}
        procs = []
        try:
            clients = {}
            for side, src in checkouts.items():
                proc, clients[side] = start_server(server_args, tmp_path / f"state-{side}",
                                                   tmp_path / f"{side}.log", src=src / "src")
                procs.append(proc)
            time.sleep(args.settle)
            rows = measure(clients, records)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=60)
            for src in checkouts.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], check=False)
    revs = {side: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True,
                                 text=True, check=True).stdout.strip()
            for side, rev in (("before", args.before), ("after", args.after))}
    res = {**revs, "target_s": TARGET_S, "records": len(records), "parallel": CONCURRENCY,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "loadavg_start": load_start,
           "loadavg_end": [round(x, 2) for x in os.getloadavg()], "elapsed_s": round(time.monotonic() - started, 1),
           "summary": summary(rows), "requests": rows}
    write_results(Path(args.out), res, markdown, plot)
    return 0


def markdown(res: dict) -> str:
    lines = [f"# `POST /train` of a new shape: before ({res['before']}) and after ({res['after']})", "",
             "| requests | before median s | after median s | before / after | after slowest s |",
             "|---|---|---|---|---|"]
    for kind, s in res["summary"].items():
        lines.append(f"| {kind} | {s['before']['median_s']:.2f} | {s['after']['median_s']:.2f} | {s['ratio']:.2f} "
                     f"| {s['after']['max_s']:.2f} |")
    lines += ["", "| request | ctx | before s | after s | asked first | same answer |", "|---|---|---|---|---|---|"]
    for r in res["requests"]:
        lines.append(f"| {r['kind']} | {r.get('ctx', 'default')} | {r['before']:.2f} | {r['after']:.2f} | {r['first']} "
                     f"| {'yes' if r['same_answer'] else 'NO'} |")
    lines += ["", f"`POST /train/plan` (the same validation, plan and gate as `POST /train`, nothing queued) to two "
              f"servers of the embedded SmolLM2-135M at once, asked in turn, the order alternating; {res['records']} "
              "records of the bundled corpus. Each new-shape request is a window size neither server had planned; "
              f"the repeated ones were asked before. Target: about {res['target_s']:.0f} s. {res['machine']}; load "
              f"average {res['loadavg_start']} at the start, {res['loadavg_end']} at the end; "
              f"{res['elapsed_s']:.0f} s in all."]
    return "\n".join(lines) + "\n"


def plot(res: dict, dest: Path) -> None:
    rows = res["requests"]
    chart(dest, [f"{r['kind']}, ctx {r.get('ctx', 'default')}" for r in rows],
          {side: [r[side] for r in rows] for side in ("before", "after")},
          legend={side: f"{side} ({res[side]})" for side in ("before", "after")},
          target=res["target_s"], target_label=f"about {res['target_s']:.0f} s",
          xlabel="POST /train/plan answer time, s (client side)", height=5.5, fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
