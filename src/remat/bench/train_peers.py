"""Throughput of full fine-tuning: remat against llama.cpp's own trainer and Hugging Face + PEFT, interleaved.

    python -m remat.bench.train_peers --llama-finetune PATH          # or $REMAT_LLAMA_FINETUNE
    python -m remat.bench.train_peers --llama-sdist llama_cpp_python-0.3.36.tar.gz   # builds it into the cache

SmolLM2-135M (the embedded GGUF), every weight trained in float32, windows of `--ctx` (512) tokens, batch 1, AdamW,
one optimizer step per window, on 2 threads each. Each round runs the three sides one after another, each in its
own child process (the order turns from round to round, so drift of a shared machine hits all alike):

- remat: `remat finetune --full --ctx 512 --steps N --pack` (its default policy and path for the job);
- llama.cpp: `llama-finetune` (see `llama_cpp`) on a float32 copy of the same GGUF (every tensor dequantized:
  the same values), one epoch of N windows, no validation split;
- Hugging Face + PEFT: `python -m remat.bench.peers --full` (gradient checkpointing, the model's own loss).

tokens/s counts the windows after the first (each side's warm-up); the peak is the child's peak resident set
(`peers.measured`, the same for all three). Where no llama-finetune can be found or built, the llama.cpp
figures are the last committed ones, with the reason. Writes bench.json, bench.md, bench.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from remat.bench import llama_cpp, peers

OUT = peers.ROOT / "bench" / "results" / "train_peers"
SIDES = ("remat", "llama.cpp", "hf")
NAMES = {"remat": "remat", "llama.cpp": "llama.cpp llama-finetune", "hf": "HF + PEFT + checkpointing"}
CHARS_PER_TOKEN = 6.4  # of peers.text_file's words under SmolLM2's tokenizer: sizes llama-finetune's text


def llama_text(src: Path, dest: Path, ctx: int, windows: int) -> Path:
    """The start of `src`, long enough for llama-finetune's `windows` windows of `ctx` (its dataset steps by ctx/2)."""
    tokens = ctx + 1 + ctx // 2 * windows + ctx // 4
    dest.write_text(src.read_text()[: int(tokens * CHARS_PER_TOKEN)])
    return dest


def run_side(side: str, ctx: int, steps: int, data: Path, llama: dict | None, timeout: float) -> dict:
    if side == "llama.cpp":
        assert llama is not None
        return llama_cpp.run(llama["binary"], llama["model"], llama["text"], ctx, 2, timeout)
    cmd = (peers.remat_cmd(None, ctx, lora=False, steps=steps, data=data) if side == "remat"
           else peers.hf_cmd(None, ctx, lora=False, steps=steps))
    r = peers.measured(cmd, timeout=timeout)
    said = r.json()
    out = {"side": side, "rc": r.rc, "peak_rss": r.peak_rss if r.rc == 0 else None, "seconds": round(r.seconds, 1),
           "tokens_per_second": said.get("tokens_per_second"), "windows": steps, "losses": said.get("losses")}
    if side == "remat" and said:
        out |= {"policy": said.get("policy"), "path": said["settings"]["path"],
                "optimizer_in_backward": said["settings"].get("optimizer_in_backward")}
    if r.rc != 0:
        out["error"] = r.error()
    return out


def summary(rounds: list[list[dict]]) -> dict[str, Any]:
    """Per side: the median tokens/s and the largest peak over the rounds; remat's ratios to each peer, per round
    (paired: the sides of one round ran minutes apart) and their median."""
    by: dict[str, list[dict]] = {s: [r for rnd in rounds for r in rnd if r["side"] == s] for s in SIDES}
    out: dict[str, Any] = {}
    for side, rs in by.items():
        rates = [r["tokens_per_second"] for r in rs if r.get("tokens_per_second")]
        peaks = [r["peak_rss"] for r in rs if r.get("peak_rss")]
        out[side] = {"tokens_per_second": statistics.median(rates) if rates else None,
                     "tokens_per_second_all": rates, "peak_rss": max(peaks) if peaks else None}
    for peer in ("llama.cpp", "hf"):
        per = []
        for rnd in rounds:
            got = {r["side"]: r.get("tokens_per_second") or 0.0 for r in rnd}
            if got.get("remat") and got.get(peer):
                per.append(got["remat"] / got[peer])
        out[f"remat_over_{peer}"] = {"per_round": per, "median": statistics.median(per) if per else None}
    return out


def committed_llama(out: Path) -> dict | None:
    """llama.cpp's figures in the committed bench.json, for a run that cannot run llama-finetune."""
    path = out / "bench.json"
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    return old["summary"].get("llama.cpp") | {"from": old.get("commit_note", "the committed bench.json")}


def markdown(res: dict) -> str:
    s = res["summary"]
    lines = [f"# Full fine-tuning throughput, SmolLM2-135M float32, ctx {res['ctx']}: remat, llama.cpp, HF + PEFT", "",
             "| side | trains | tokens/s (median) | tokens/s per round | peak RSS MiB | remat / side (per round) |",
             "|---|---|---:|---|---:|---|"]
    for side in SIDES:
        f = s[side]
        rate = "–" if f["tokens_per_second"] is None else f"{f['tokens_per_second']:.1f}"
        each = ", ".join(f"{x:.1f}" for x in f["tokens_per_second_all"]) or "–"
        peak = "–" if f["peak_rss"] is None else f"{f['peak_rss'] / (1 << 20):,.0f}"
        ratio = "–"
        if side != "remat" and s[f"remat_over_{side}"]["median"] is not None:
            r = s[f"remat_over_{side}"]
            ratio = f"{r['median']:.2f}× ({', '.join(f'{x:.2f}' for x in r['per_round'])})"
        lines.append(f"| {NAMES[side]} | {res['trains'][side]} | {rate} | {each} | {peak} | {ratio} |")
    lines += ["", res["method"]]
    if res.get("llama_note"):
        lines += ["", f"llama.cpp: {res['llama_note']}"]
    lines += ["", f"Machine: {res['machine']}; {res['rounds']} rounds, {res['steps']} windows a side a round "
              f"(the first is the warm-up), {res['elapsed_s']:.0f} s in all. The machine was shared with other "
              "jobs (load average above): read the per-round ratios, not the absolute rates."]
    return "\n".join(lines) + "\n"


def plot(res: dict, dest: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [NAMES[x] for x in SIDES]
    a.barh(names, [s[x]["tokens_per_second"] or 0 for x in SIDES], color=["tab:blue", "tab:green", "tab:orange"])
    a.set_xlabel("tokens/s (median of rounds)")
    b.barh(names, [(s[x]["peak_rss"] or 0) / (1 << 20) for x in SIDES], color=["tab:blue", "tab:green", "tab:orange"])
    b.set_xlabel("peak RSS, MiB")
    fig.suptitle(f"SmolLM2-135M full fine-tuning, float32, ctx {res['ctx']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


METHOD = ("What each side trains: every weight of SmolLM2-135M-Instruct in float32 (the embedded Q4_1 GGUF's values, "
          "dequantized: remat and transformers dequantize it on load, llama.cpp reads a float32 GGUF written by "
          "gguf-py), AdamW, one window of {ctx} tokens a step. remat: `remat finetune --full --pack` with its own "
          "choices for the job (policy {policy}, path {path}, optimizer in the backward: {oib}), chunked loss. "
          "llama.cpp: `llama-finetune -c {ctx} -b {ctx} -ub {ctx} -t 2 --val-split 0` (every tensor trained; its "
          "rate from its own progress clock, whole seconds over the windows after the first). Hugging Face: the "
          "model's own forward and loss, `gradient_checkpointing_enable()`, `torch.optim.AdamW`. Peak RSS: the "
          "whole child process (weights, grads or not, optimizer state, activations, runtime).")


def _llama(a: argparse.Namespace, data: Path) -> tuple[dict | None, str]:
    binary, how = llama_cpp.find_binary(a.llama_finetune, a.llama_sdist)
    if binary is None:
        return None, how
    model = llama_cpp.default_float32_gguf()
    text = llama_text(data, llama_cpp.cache_root() / f"train-{a.ctx}-{a.steps}.txt", a.ctx, a.steps)
    return {"binary": binary, "model": model, "text": text}, f"llama-finetune {how}"


def _save(path: Path, rounds: list[list[dict]], machine: str, note: str, elapsed: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "llama_note": note, "elapsed_s": elapsed, "rounds": rounds},
                               indent=1, default=str) + "\n")


def _rounds(a: argparse.Namespace, data: Path, llama: dict | None, rounds: list[list[dict]], save: Any
            ) -> list[list[dict]]:
    """The rounds after `rounds`, each side once a round, the order turned each round; saved after every run."""
    sides = [s for s in SIDES if s != "llama.cpp" or llama is not None]
    for i in range(len(rounds), a.rounds):
        turn = 2 * i % len(sides)  # round 2 puts remat between its two peers
        order = sides[turn:] + sides[:turn]
        rounds.append([])
        for side in order:
            print(f"train_peers: round {i + 1}/{a.rounds} {side}", file=sys.stderr, flush=True)
            rounds[-1].append(run_side(side, a.ctx, a.steps, data, llama, a.timeout) | {"round": i + 1})
            print(f"  -> {rounds[-1][-1]}", file=sys.stderr, flush=True)
            save(rounds)
    return rounds


def main(argv: list[str] | None = None) -> int:
    import time
    p = argparse.ArgumentParser(prog="python -m remat.bench.train_peers", description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="windows a side trains each round (the first: warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-finetune", default=None, help=f"the binary (default ${llama_cpp.ENV_BINARY})")
    p.add_argument("--llama-sdist", default=None,
                   help=f"llama-cpp-python sdist to build it from (${llama_cpp.ENV_SDIST})")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--report-only", action="store_true", help="no runs: the report from the rounds in runs.json")
    p.add_argument("--fresh", action="store_true", help="forget the rounds runs.json holds")
    a = p.parse_args(argv)
    started, machine = time.perf_counter(), peers.machine()
    data = peers.text_file(a.out / ".text.txt")
    llama, note = _llama(a, data)
    saved = a.out / "runs.json"
    if a.report_only:
        kept = json.loads(saved.read_text())
        rounds, machine, note = kept["rounds"], kept["machine"], kept.get("llama_note", note)
        a.rounds, started = len(rounds), time.perf_counter() - kept.get("elapsed_s", 0.0)
    else:  # a rerun goes on from the rounds runs.json holds, up to --rounds in all (--fresh: from none)
        kept = json.loads(saved.read_text()) if saved.exists() and not a.fresh else {"rounds": [], "elapsed_s": 0.0}
        started -= kept["elapsed_s"]
        rounds = _rounds(a, data, llama, kept["rounds"],
                         lambda r: _save(saved, r, machine, note, time.perf_counter() - started))
    s = summary(rounds)
    if llama is None:
        old = committed_llama(a.out)
        s["llama.cpp"] = old or s["llama.cpp"]
        note = f"not run here ({note}); " + ("figures from the last committed run" if old else "no figures")
    remat_run: dict = next((r for rnd in rounds for r in rnd if r["side"] == "remat" and r.get("policy")), {})
    res = {"ctx": a.ctx, "steps": a.steps, "rounds": a.rounds, "machine": machine, "llama_note": note,
           "trains": {"remat": "every weight", "llama.cpp": "every tensor", "hf": "every weight"},
           "method": METHOD.format(ctx=a.ctx, policy=remat_run.get("policy"), path=remat_run.get("path"),
                                   oib=remat_run.get("optimizer_in_backward")),
           "runs": rounds, "summary": s, "elapsed_s": time.perf_counter() - started}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (a.out / "bench.md").write_text(markdown(res))
    plot(res, a.out / "bench.png")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
