"""Decode tokens/s of `remat serve` from float32 weights (`--weights float32`), from the stored blocks (`--weights
blocks`, the default: `remat.serve.packed`) and from the blocks with the decode step compiled (`--compile`), beside
llama.cpp's `llama-bench` on the same GGUF and threads.

    python -m remat.bench.serve_decode --llama-bench PATH      # default model (embedded SmolLM2-135M), ~4 min
    python -m remat.bench.serve_decode --rounds 1 --out /tmp/serve_decode

Three real servers (`remat serve --threads T`, one per mode) on free 127.0.0.1 ports, one request at a time. A
round: one streamed-free /completion of 128 tokens (`ignore_eos`, greedy: temperature 0) from each server, then
`llama-bench -m GGUF -p 0 -n 128 -t T -r 1` (tg128: 128 tokens decoded after an empty prompt). Rounds interleave
the four (F B C L F B C L ...): drift of a shared machine hits every side. A server's tokens/s: its answer's
`timings` (predicted_n / predicted_ms: decoding only, the prompt left out). Target: remat's best median tokens/s
(the compiled step's) at least 0.5x llama-bench's median.

The per-token breakdown (in this process, the engine of the blocks mode, one row, default sampling settings):
the forward without the head, the head (a hidden state to the vocabulary's logits), and sampling (`pick`).

Writes results.json, results.md and results.png into --out (default bench/results/serve_decode).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from remat.bench import serve_slowdown as slow
from remat.bench.plan_time import write_results

ROOT = slow.ROOT
TOKENS = 128
TARGET = 0.5
MODES = {"float32": ["--weights", "float32"], "blocks": ["--weights", "blocks"],
         "blocks+compile": ["--weights", "blocks", "--compile"]}
LLAMA_BENCH = "REMAT_LLAMA_BENCH"


def find_llama_bench(given: str | None) -> Path | None:
    """`--llama-bench`, `$REMAT_LLAMA_BENCH`, or one next to a llama-finetune built by `remat.bench.llama_cpp`."""
    from remat.bench import llama_cpp

    for path in (given, os.environ.get(LLAMA_BENCH)):
        if path:
            return Path(path) if Path(path).is_file() else None
    built = sorted(llama_cpp.cache_root().glob("*/build/bin/llama-bench"))
    return built[-1] if built else (Path(found) if (found := shutil.which("llama-bench")) else None)


def llama_round(binary: Path, gguf: Path, threads: int) -> float | None:
    """One `llama-bench -p 0 -n 128 -t threads -r 1`: its tokens/s, None when it failed."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(TOKENS), "-t", str(threads), "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return float(json.loads(done.stdout)[0]["avg_ts"])


def server_round(client: slow.Client, prompt: str) -> float:
    """One greedy /completion of 128 tokens: decode tokens/s from its timings."""
    body = {"prompt": prompt, "n_predict": TOKENS, "ignore_eos": True, "temperature": 0}
    t = client.ok("POST", "/completion", body)["timings"]
    return t["predicted_n"] / t["predicted_ms"] * 1e3


def breakdown(model: str | None, threads: int, steps: int = 40) -> dict:
    """ms per token of the blocks engine's forward without its head, its head, and sampling (median of `steps`)."""
    import torch

    from remat.serve.batch import prefill_cache
    from remat.serve.engine import Engine
    from remat.serve.sampling import Row, Sampling, pick

    torch.set_num_threads(threads)
    engine = Engine(model, weights="blocks")
    engine.load()
    head = engine.model.get_output_embeddings()
    hidden: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, args, out: hidden.append(args[0]))
    times: dict[str, list[float]] = {"forward": [], "head": [], "sampling": []}
    cache = prefill_cache(engine.model)
    row = Row(Sampling(), torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = engine.forward(torch.tensor([engine.prompt_ids("The capital of France is")]), cache)
        for _ in range(steps):
            t0 = time.perf_counter()
            out = engine.forward(torch.tensor([[5]]), cache)
            t1 = time.perf_counter()
            head(hidden[-1])
            t2 = time.perf_counter()
            pick(out.logits[:, -1], [row])
            t3 = time.perf_counter()
            times["forward"].append((t1 - t0) - (t2 - t1))  # the head ran inside the forward too
            times["head"].append(t2 - t1)
            times["sampling"].append(t3 - t2)
    hook.remove()
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()} | {"serving": engine.serving}


def measure(args: argparse.Namespace) -> dict:
    from remat.models.load import default_gguf_path

    gguf = Path(args.model) if args.model else default_gguf_path()
    binary = find_llama_bench(args.llama_bench)
    questions = slow.prompts()
    rates: dict[str, list[float]] = {m: [] for m in (*MODES, "llama-bench")}
    servers = {}
    try:
        for mode in MODES:
            tmp = Path(args.tmp) / mode
            tmp.mkdir(parents=True, exist_ok=True)
            servers[mode] = slow.start_server(args, tmp / "state", tmp / "server.log", parallel=1,
                                              extra=MODES[mode])
        compiled = re.search(r"decode step compiled in (\d+) s", (Path(args.tmp) / "blocks+compile" / "server.log")
                             .read_text())
        for mode in MODES:  # warm-up
            server_round(servers[mode][1], questions[0])
        for i in range(args.rounds):
            for mode in MODES:
                rates[mode].append(round(server_round(servers[mode][1], questions[i % len(questions)]), 2))
            if binary is not None:
                tps = llama_round(binary, gguf, args.threads)
                if tps is not None:
                    rates["llama-bench"].append(round(tps, 2))
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]}" for k, v in rates.items() if v), file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    med = {k: round(statistics.median(v), 2) for k, v in rates.items() if v}
    ratio = {m: round(med[m] / med["llama-bench"], 3) for m in MODES} if "llama-bench" in med else None
    return {"model": gguf.name, "threads": args.threads, "rounds": rates, "median_tps": med,
            "blocks_over_float32": med["blocks"] / med["float32"], "over_llama_bench": ratio,
            "compiled_over_blocks": med["blocks+compile"] / med["blocks"],
            "compile_seconds": int(compiled.group(1)) if compiled else None,
            "target": TARGET, "met": ratio is not None and max(ratio.values()) >= TARGET, "llama_bench": str(binary),
            "per_token_ms": breakdown(args.model, args.threads), "load_average": os.getloadavg(),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"}


def markdown(res: dict) -> str:
    med, ms = res["median_tps"], res["per_token_ms"]
    ratio = res["over_llama_bench"]
    lines = [f"# remat serve decode tokens/s: {res['model']}, {res['threads']} threads", "",
             f"Machine: {res['machine']}; load average at the end {', '.join(f'{x:.1f}' for x in res['load_average'])}"
             " (a shared machine: other jobs ran meanwhile, so the figures are noisy; the rounds interleave the"
             " sides so that drift hits each).", "",
             "| | median tokens/s | rounds |", "|---|---|---|"]
    for k, v in res["rounds"].items():
        lines.append(f"| {k} | {med.get(k, 'n/a')} | {', '.join(map(str, v)) or 'not run'} |")
    lines += ["", f"- blocks / float32: **{res['blocks_over_float32']:.2f}x**; the compiled step / blocks: "
              f"**{res['compiled_over_blocks']:.2f}x** (compiled in {res['compile_seconds']} s as the server loaded)",
              f"- / llama-bench tg128: blocks **{ratio['blocks']:.2f}x**, blocks+compile "
              f"**{ratio['blocks+compile']:.2f}x** (target {TARGET}x: {'met' if res['met'] else 'not met'})"
              if ratio else "- llama-bench: not run (no binary)",
              f"- serving copies: {res['per_token_ms']['serving']['packed'] / 2**20:.1f} MiB packed int4 "
              f"({res['per_token_ms']['serving']['layers']} layers), "
              f"{res['per_token_ms']['serving']['float'] / 2**20:.1f} MiB made float32", "",
              "Per token (blocks, eager, one row, in-process, median ms): "
              f"forward without the head {ms['forward']}, head {ms['head']}, sampling {ms['sampling']}.", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in res["rounds"].items():
        ax.plot(range(1, len(v) + 1), v, "o-", label=k)
    ax.set(xlabel="round", ylabel="decode tokens/s", ylim=(0, None),
           title=f"{res['model']}, {res['threads']} threads: remat serve vs llama-bench tg128")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--llama-bench", help=f"the llama-bench binary (or ${LLAMA_BENCH})")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_decode"))
    args = p.parse_args(argv)
    args.max_slowdown_ppm = 50_000
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="remat-decode-") as tmp:
        args.tmp = tmp
        res = measure(args)
    write_results(out, res, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
