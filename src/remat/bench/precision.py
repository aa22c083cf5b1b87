"""The precision as shipped against the model as it was: `make demo`'s job four ways, interleaved.

    python -m remat.bench.precision [--steps 8] [--rounds 3]

The demo (`remat finetune`: the embedded SmolLM2 Q4_1 GGUF, LoRA r 8, its defaults), each variant in its own child
process, one after another in each round, the order turned round by round (drift of a shared machine hits all alike):

- as filed: the code of `AS_FILED` (a git worktree, this environment), the last commit before the weights stayed as
  stored: the demo as it ran when the issue "Precision as shipped" asked for these ratios of it ("today's");
- float32 weights: the GGUF dequantized once into a float32 folder, `--dtype float32` (every model, before the
  weights stayed as stored and the compute dtype was chosen);
- blocks, float32: the GGUF's own blocks, made float32 inside the step, `--dtype float32`;
- blocks, auto: the same with `--dtype auto` (bf16 where the CPU computes it natively).

Figures: the planned total (the receipt's plan, the whole process), the child's peak resident set (`os.wait4`), and
tokens/s (the receipt's), each variant against the two float32 baselines. The three float32 variants must give the
same losses, bit for bit (checked: a difference is an error here). Writes bench.json, bench.md, bench.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from remat.bench import llama_cpp, peers, plan_time

OUT = peers.ROOT / "bench" / "results" / "precision"
AS_FILED = "4648488"  # main before 65b9b55 (the GGUF's blocks kept): every model held in float32
VARIANTS = ("as filed", "float32 weights", "blocks, float32", "blocks, auto")
BASES = ("as filed", "float32 weights")
FLOAT32 = VARIANTS[:3]  # computing in float32: one sequence of losses


def float32_folder(dest: Path) -> Path:
    """The embedded GGUF as a float32 transformers folder (its weights dequantized once, its tokenizer)."""
    if not (dest / "model.safetensors").exists():
        from remat.models.load import load_model

        lm = load_model(None, as_stored=False)
        lm.model.save_pretrained(dest)
        lm.tokenizer.save_pretrained(dest)
    return dest


def command(variant: str, folder: Path, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "remat", "finetune", "--steps", str(steps), "--json"]
    if variant == "as filed":  # float32 then, and no --dtype
        return cmd
    model = ["--model", str(folder)] if variant == "float32 weights" else []
    return [*cmd, "--dtype", "auto" if variant.endswith("auto") else "float32", *model]


def run(variant: str, folder: Path, steps: int, timeout: float, as_filed: Path) -> dict:
    env = {"PYTHONPATH": str(as_filed / "src")} if variant == "as filed" else None
    r = peers.measured(command(variant, folder, steps), timeout=timeout, env=env)
    said = r.json()
    out = {"variant": variant, "rc": r.rc, "peak_rss": r.peak_rss if r.rc == 0 else None,
           "planned_total": said.get("plan", {}).get("total"), "frozen": said.get("plan", {}).get("frozen"),
           "tokens_per_second": said.get("tokens_per_second"), "losses": said.get("losses"),
           "dtype": said.get("dtype"), "policy": said.get("policy")}
    return out | ({"error": r.error()} if r.rc else {})


def summary(rounds: list[list[dict]]) -> dict[str, Any]:
    """Per variant: the median planned total, peak and tokens/s; each against each baseline's, per round (paired)
    and their median."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        rs = [r for rnd in rounds for r in rnd if r["variant"] == v and r["rc"] == 0]
        out[v] = {k: statistics.median(r[k] for r in rs) if rs else None
                  for k in ("planned_total", "peak_rss", "tokens_per_second", "frozen")}
        out[v]["dtype"] = (rs[0]["dtype"] or "float32") if rs else None  # as filed: no dtype in its receipt
        out[v]["over"] = {base: paired(rounds, v, base) for base in BASES}
    return out


def paired(rounds: list[list[dict]], variant: str, base: str) -> dict[str, dict]:
    """`variant`'s figures over `base`'s, round by round, and their median."""
    ratios: dict[str, list[float]] = {"planned_total": [], "peak_rss": [], "tokens_per_second": []}
    for rnd in rounds:
        got = {r["variant"]: r for r in rnd if r["rc"] == 0}
        if variant in got and base in got:
            for k in ratios:
                ratios[k].append(got[variant][k] / got[base][k])
    return {k: {"per_round": x, "median": statistics.median(x) if x else None} for k, x in ratios.items()}


def same_losses(rounds: list[list[dict]]) -> bool:
    """Whether the float32 variants gave one sequence of losses, every round."""
    losses = {json.dumps(r["losses"]) for rnd in rounds for r in rnd if r["rc"] == 0 and r["variant"] in FLOAT32}
    return len(losses) == 1


def markdown(res: dict) -> str:
    s, mib = res["summary"], 1 << 20
    keys = ("planned_total", "peak_rss", "tokens_per_second")
    lines = [f"# The demo's precision, as shipped against as it was (SmolLM2-135M Q4_1, LoRA r 8, {res['steps']} "
             "steps)", "",
             "| variant | compute | frozen MiB | planned total MiB | process peak MiB | tokens/s | "
             "planned over as filed | peak | tokens/s | planned over float32 weights | peak | tokens/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in VARIANTS:
        f = s[v]
        if f["planned_total"] is None:
            lines.append(f"| {v} |" + " – |" * 11)
            continue
        ratio = " | ".join(f"{f['over'][b][k]['median']:.2f}×" if f["over"][b][k]["median"] else "–"
                           for b in BASES for k in keys)
        lines.append(f"| {v} | {f['dtype']} | {f['frozen'] / mib:,.1f} | {f['planned_total'] / mib:,.1f} | "
                     f"{f['peak_rss'] / mib:,.1f} | {f['tokens_per_second']:.1f} | {ratio} |")
    lines += ["", f"As filed: the code of {AS_FILED}, the last commit before the GGUF's blocks were kept (every model "
              "held in float32). The ratios: the medians of the rounds' paired ratios. The float32 variants' losses "
              "are " + ("equal, bit for bit, in every round." if res["same_losses"] else "NOT equal."),
              "", f"Machine: {res['machine']}; {res['rounds']} rounds, {res['elapsed_s']:.0f} s in all. Planned "
              "figures are exact; the peak and tokens/s are measured on a "
              "shared machine: read the paired ratios."]
    return "\n".join(lines) + "\n"


def plot(res: dict, dest: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, mib = res["summary"], 1 << 20
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    colours = ["tab:brown", "tab:gray", "tab:blue", "tab:green"]
    a.barh(VARIANTS, [(s[v]["peak_rss"] or 0) / mib for v in VARIANTS], color=colours)
    a.scatter([(s[v]["planned_total"] or 0) / mib for v in VARIANTS], VARIANTS, color="black", zorder=3,
              label="planned total")
    a.set_xlabel("process peak MiB (bars)")
    a.legend(fontsize=8)
    b.barh(VARIANTS, [s[v]["tokens_per_second"] or 0 for v in VARIANTS], color=colours)
    b.set_xlabel("tokens/s (median of rounds)")
    fig.suptitle("make demo: SmolLM2-135M Q4_1, LoRA r 8", fontsize=10)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def run_rounds(a: argparse.Namespace, folder: Path, as_filed: Path) -> list[list[dict]]:
    """Every variant once a round, in fresh processes, the order turned round by round."""
    rounds: list[list[dict]] = []
    for i in range(a.rounds):
        turn = i % len(VARIANTS)
        rounds.append([])
        for v in VARIANTS[turn:] + VARIANTS[:turn]:
            print(f"precision: round {i + 1}/{a.rounds} {v}", file=sys.stderr, flush=True)
            rounds[-1].append(run(v, folder, a.steps, a.timeout, as_filed) | {"round": i + 1})
            print(f"  -> { {k: x for k, x in rounds[-1][-1].items() if k != 'losses'} }", file=sys.stderr, flush=True)
    return rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remat.bench.precision", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steps each variant trains a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    started = time.perf_counter()
    folder = float32_folder(llama_cpp.cache_root().parent / "smollm2-float32")
    with tempfile.TemporaryDirectory() as tmp:
        as_filed = plan_time.worktree(AS_FILED, Path(tmp) / "as-filed")
        try:
            rounds = run_rounds(a, folder, as_filed)
        finally:
            plan_time.remove_worktree(as_filed)
    res = {"steps": a.steps, "rounds": a.rounds, "machine": peers.machine(),
           "elapsed_s": time.perf_counter() - started, "same_losses": same_losses(rounds),
           "summary": summary(rounds), "runs": rounds}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench.json").write_text(json.dumps(res, indent=1) + "\n")
    (a.out / "bench.md").write_text(markdown(res))
    plot(res, a.out / "bench.png")
    print(markdown(res))
    return 0 if res["same_losses"] else 1


if __name__ == "__main__":
    sys.exit(main())
