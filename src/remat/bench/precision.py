"""The precision as shipped against the model as it was: `make demo`'s job three ways, interleaved.

    python -m remat.bench.precision [--steps 8] [--rounds 3]

The demo (`remat finetune`: the embedded SmolLM2 Q4_1 GGUF, LoRA r 8, its defaults), each variant in its own child
process, one after another in each round, the order turned round by round (drift of a shared machine hits all alike):

- float32 weights: the GGUF dequantized once into a float32 folder, `--dtype float32` (every model, before the
  weights stayed as stored and the compute dtype was chosen);
- blocks, float32: the GGUF's own blocks, made float32 inside the step, `--dtype float32`;
- blocks, auto: the same with `--dtype auto` (bf16 where the CPU computes it natively).

Figures: the planned total (the receipt's plan, the whole process), the child's peak resident set (`os.wait4`), and
tokens/s (the receipt's). The two float32 variants must give the same losses, bit for bit (checked: a difference is
an error here). Writes bench.json, bench.md, bench.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from remat.bench import llama_cpp, peers

OUT = peers.ROOT / "bench" / "results" / "precision"
VARIANTS = ("float32 weights", "blocks, float32", "blocks, auto")
BASE = "float32 weights"


def float32_folder(dest: Path) -> Path:
    """The embedded GGUF as a float32 transformers folder (its weights dequantized once, its tokenizer)."""
    if not (dest / "model.safetensors").exists():
        from remat.models.load import load_model

        lm = load_model(None, as_stored=False)
        lm.model.save_pretrained(dest)
        lm.tokenizer.save_pretrained(dest)
    return dest


def command(variant: str, folder: Path, steps: int) -> list[str]:
    model = ["--model", str(folder)] if variant == BASE else []
    dtype = "auto" if variant.endswith("auto") else "float32"
    return [sys.executable, "-m", "remat", "finetune", "--steps", str(steps), "--json", "--dtype", dtype, *model]


def run(variant: str, folder: Path, steps: int, timeout: float) -> dict:
    r = peers.measured(command(variant, folder, steps), timeout=timeout)
    said = r.json()
    out = {"variant": variant, "rc": r.rc, "peak_rss": r.peak_rss if r.rc == 0 else None,
           "planned_total": said.get("plan", {}).get("total"), "frozen": said.get("plan", {}).get("frozen"),
           "tokens_per_second": said.get("tokens_per_second"), "losses": said.get("losses"),
           "dtype": said.get("dtype"), "policy": said.get("policy")}
    return out | ({"error": r.error()} if r.rc else {})


def summary(rounds: list[list[dict]]) -> dict[str, Any]:
    """Per variant: the median planned total, peak and tokens/s; each against the float32 weights', per round
    (paired) and their median."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        rs = [r for rnd in rounds for r in rnd if r["variant"] == v and r["rc"] == 0]
        out[v] = {k: statistics.median(r[k] for r in rs) if rs else None
                  for k in ("planned_total", "peak_rss", "tokens_per_second", "frozen")}
        out[v]["dtype"] = rs[0]["dtype"] if rs else None
        ratios: dict[str, list[float]] = {"planned_total": [], "peak_rss": [], "tokens_per_second": []}
        for rnd in rounds:
            got = {r["variant"]: r for r in rnd if r["rc"] == 0}
            if v in got and BASE in got:
                for k in ratios:
                    ratios[k].append(got[v][k] / got[BASE][k])
        out[v]["over_float32_weights"] = {k: {"per_round": x, "median": statistics.median(x) if x else None}
                                          for k, x in ratios.items()}
    return out


def same_losses(rounds: list[list[dict]]) -> bool:
    """Whether the float32 variants gave one sequence of losses, every round."""
    losses = {json.dumps(r["losses"]) for rnd in rounds for r in rnd if r["rc"] == 0 and "float32" in r["variant"]}
    return len(losses) == 1


def markdown(res: dict) -> str:
    s, mib = res["summary"], 1 << 20
    lines = [f"# The demo's precision, as shipped against as it was (SmolLM2-135M Q4_1, LoRA r 8, {res['steps']} "
             "steps)", "",
             "| variant | compute | frozen MiB | planned total MiB | process peak MiB | tokens/s | planned | peak | "
             "tokens/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v in VARIANTS:
        f = s[v]
        if f["planned_total"] is None:
            lines.append(f"| {v} | – | – | – | – | – | – | – | – |")
            continue
        r = f["over_float32_weights"]
        ratio = " | ".join(f"{r[k]['median']:.2f}×" for k in ("planned_total", "peak_rss", "tokens_per_second"))
        lines.append(f"| {v} | {f['dtype']} | {f['frozen'] / mib:,.1f} | {f['planned_total'] / mib:,.1f} | "
                     f"{f['peak_rss'] / mib:,.1f} | {f['tokens_per_second']:.1f} | {ratio} |")
    lines += ["", "The last three columns: each variant against the float32 weights, the median of the rounds' "
              "paired ratios. The float32 variants' losses are " + ("equal, bit for bit, in every round."
                                                                    if res["same_losses"] else "NOT equal."),
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
    colours = ["tab:gray", "tab:blue", "tab:green"]
    a.barh(VARIANTS, [(s[v]["peak_rss"] or 0) / mib for v in VARIANTS], color=colours, label="process peak")
    a.scatter([(s[v]["planned_total"] or 0) / mib for v in VARIANTS], VARIANTS, color="black", zorder=3,
              label="planned total")
    a.set_xlabel("MiB")
    a.legend(fontsize=8)
    b.barh(VARIANTS, [s[v]["tokens_per_second"] or 0 for v in VARIANTS], color=colours)
    b.set_xlabel("tokens/s (median of rounds)")
    fig.suptitle("make demo: SmolLM2-135M Q4_1, LoRA r 8", fontsize=10)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remat.bench.precision", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steps each variant trains a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    started = time.perf_counter()
    folder = float32_folder(llama_cpp.cache_root().parent / "smollm2-float32")
    rounds: list[list[dict]] = []
    for i in range(a.rounds):
        order = VARIANTS[i % 3:] + VARIANTS[:i % 3]
        rounds.append([])
        for v in order:
            print(f"precision: round {i + 1}/{a.rounds} {v}", file=sys.stderr, flush=True)
            rounds[-1].append(run(v, folder, a.steps, a.timeout) | {"round": i + 1})
            print(f"  -> { {k: x for k, x in rounds[-1][-1].items() if k != 'losses'} }", file=sys.stderr, flush=True)
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
