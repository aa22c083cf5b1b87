"""Batched decoding in `remat serve`: four concurrent clients' aggregate decode tokens/s against one client's,
each client's time per token, and the training job's slowdown bound under that load.

    python -m remat.bench.serve_batch                          # default model (embedded SmolLM2-135M), ~8 min
    python -m remat.bench.serve_batch --rounds 1 --seconds 10 --model tiny-llama --out /tmp/serve_batch

One real server (`remat serve --parallel 4`) on a free 127.0.0.1 port; requests leave sampling to the server,
whose defaults are llama.cpp's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat_last_n 64).

Throughput, interleaved (1 4 1 4 ...: drift of a shared machine hits both sides): a round of one client, then a
round of four clients started together. Each client streams one /completion of 128 tokens (`ignore_eos`: every
answer has 128) and notes when each token arrives (the stream's chunks carry their token ids). A round's decode
tokens/s: the tokens that arrived while every client was decoding (from the last client's first token to the
first client's last one: no prompt is being processed then) over that time; also over the whole round (from the
first token any client got to the last one, the others' prompts and the stragglers' tails included). Target:
four clients' tokens/s at least 2.5x one client's (medians of the rounds). A client's time per token: the gaps
between its tokens' arrivals (a chunk of k tokens counts its gap k times over k); p50 and p95 per client.

Training under load (serve_slowdown's machinery): the four clients loop 128-token completions for `--seconds` a
phase, baseline, training, baseline, training (B T B T); in T a LoRA job trains. The client slowdown is
(1 - tokens/s in T / tokens/s in B) x 1e6 with tokens/s pooled from the answers' `timings` (decoding only); the
batch is four rows in both. Target: at most --max-slowdown-ppm; the server's own measure is the job's
`slowdown_ppm` (the scheduler's, by batch size).

Writes results.json, results.md and results.png into --out (default bench/results/serve_batch).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

from remat.base.settings import percentile
from remat.bench import serve_slowdown as slow
from remat.bench.plan_time import write_results

ROOT = slow.ROOT
CLIENTS = 4
TOKENS = 128
TARGET = 2.5


def stream(port: int, prompt: str, n: int = TOKENS) -> dict:
    """One streamed /completion: when each token arrived, and the server's timings."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True, "stream": True}).encode()
    arrivals: list[tuple[float, int]] = []
    final: dict = {}
    try:
        conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/completion: HTTP {resp.status}: {resp.read()[:300]!r}")
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"/completion stream: {chunk['error']}")
            if chunk.get("stop"):
                final = chunk
                break
            if chunk.get("tokens"):
                arrivals.append((time.perf_counter(), len(chunk["tokens"])))
    finally:
        conn.close()
    return {"arrivals": arrivals, "tokens": sum(k for _, k in arrivals), "timings": final.get("timings", {})}


def gaps(arrivals: list[tuple[float, int]]) -> list[float]:
    """Seconds per token between arrivals (a chunk of k tokens: its gap / k, k times)."""
    out: list[float] = []
    for (t0, _), (t1, k) in itertools.pairwise(arrivals):
        out += [(t1 - t0) / k] * k
    return out


def run_round(port: int, questions: list[str], clients: int, offset: int) -> dict:
    """`clients` streams started together; the round's decode tokens/s and each client's time per token."""
    results: list[dict] = [{} for _ in range(clients)]
    barrier = threading.Barrier(clients)

    def one(i: int) -> None:
        barrier.wait()
        results[i] = stream(port, questions[(offset + i) % len(questions)])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = min(r["arrivals"][0][0] for r in results)
    last = max(r["arrivals"][-1][0] for r in results)
    # while every client decodes: from the last client's first token to the first client's last one
    start, end = max(r["arrivals"][0][0] for r in results), min(r["arrivals"][-1][0] for r in results)
    during = sum(k for r in results for t, k in r["arrivals"] if start < t <= end)
    tokens = sum(r["tokens"] for r in results)
    per_client = [gaps(r["arrivals"]) for r in results]
    return {"clients": clients, "tokens": tokens, "seconds": end - start, "tps": during / (end - start),
            "tps_whole": (tokens - clients) / (last - first),  # each client's first token marks its start
            "tpt_p50_ms": [percentile(g, 0.5) * 1e3 for g in per_client],
            "tpt_p95_ms": [percentile(g, 0.95) * 1e3 for g in per_client],
            "gaps_ms": [[round(x * 1e3, 2) for x in g] for g in per_client]}


def load_phase(port: int, questions: list[str], seconds: float) -> dict:
    """CLIENTS clients loop 128-token streams for `seconds`; decode timings pooled from the answers."""
    lock = threading.Lock()
    tot: dict = {"requests": 0, "tokens": 0, "predicted_ms": 0.0, "gaps": []}
    deadline = time.monotonic() + seconds

    def loop(i: int) -> None:
        n = i
        while time.monotonic() < deadline:
            r = stream(port, questions[n % len(questions)])
            n += CLIENTS
            with lock:
                tot["requests"] += 1
                tot["tokens"] += r["timings"].get("predicted_n", 0)
                tot["predicted_ms"] += r["timings"].get("predicted_ms", 0.0)
                tot["gaps"] += gaps(r["arrivals"])

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tot["tps"] = tot["tokens"] / tot["predicted_ms"] * 1e3 if tot["predicted_ms"] else 0.0
    tot["tpt_p95_ms"] = percentile(tot["gaps"], 0.95) * 1e3 if tot["gaps"] else None
    del tot["gaps"]
    return tot


def training_under_load(client: slow.Client, port: int, questions: list[str], args) -> dict:
    records = slow.corpus_records(8)
    pairs = []
    for i in range(args.pairs):
        print(f"training under load, pair {i + 1}: baseline", file=sys.stderr)
        base = load_phase(port, questions, args.seconds)
        job_id = slow.job(client, False, records, args.ctx)
        during = load_phase(port, questions, args.seconds)
        j = slow.finish_job(client, job_id)
        print(f"  {base['tps']:.1f} -> {during['tps']:.1f} tok/s, job {j['status']}, {j['chunks']} chunks, "
              f"server {j['slowdown_ppm']} ppm", file=sys.stderr)
        pairs.append({"baseline": base, "training": during,
                      "job": {k: j.get(k) for k in ("id", "status", "step", "chunks", "window_p50", "window_p95",
                                                    "slowdown_ppm", "slowdown_source")}})
    tps_b = slow.pooled([p["baseline"] for p in pairs])
    tps_t = slow.pooled([p["training"] for p in pairs])
    server = [p["job"]["slowdown_ppm"] for p in pairs if p["job"]["slowdown_ppm"] is not None]
    return {"tps_baseline": round(tps_b, 2), "tps_training": round(tps_t, 2),
            "slowdown_ppm_client": slow.ppm(tps_t, tps_b), "slowdown_ppm_server": max(server) if server else None,
            "pairs": pairs}


def markdown(res: dict) -> str:
    t, rounds = res["throughput"], res["throughput"]["rounds"]
    lines = [
        "# Batched decoding: four clients against one",
        "",
        (f"Model `{res['model']}`, `--parallel {CLIENTS}`, `--threads {res['threads']}`, the server's default "
         f"sampling (llama.cpp's); each client streams one /completion of {TOKENS} tokens (`ignore_eos`). "
         f"{len(rounds) // 2} rounds of one client and of four, interleaved. Machine: {res['machine']}, load "
         f"average {res['loadavg_start']} at the start, {res['loadavg_end']} at the end (shared); "
         f"{res['elapsed_s']:.0f} s in all."),
        "",
        "| round | clients | decode tok/s (all decoding) | over the whole round | tokens | seconds (all decoding) "
        "| time per token p50 ms (each client) | p95 ms (each client) |",
        "|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for i, r in enumerate(rounds):
        lines.append(f"| {i // 2 + 1} | {r['clients']} | {r['tps']:.2f} | {r['tps_whole']:.2f} | {r['tokens']} "
                     f"| {r['seconds']:.2f} "
                     f"| {', '.join(f'{x:.1f}' for x in r['tpt_p50_ms'])} "
                     f"| {', '.join(f'{x:.1f}' for x in r['tpt_p95_ms'])} |")
    lines += [
        "",
        (f"Median decode tokens/s while every client decodes: one client {t['tps_one']:.2f}, four clients "
         f"{t['tps_four']:.2f}: **{t['ratio']:.2f}x** (target ≥ {TARGET}x: "
         f"**{'met' if t['target_met'] else 'not met'}**); over the whole rounds {t['ratio_whole']:.2f}x."),
    ]
    if res.get("training"):
        tr = res["training"]
        server = tr["slowdown_ppm_server"]
        lines += [
            "",
            "## The training job's slowdown bound under that load",
            "",
            (f"Four clients loop {TOKENS}-token completions, {res['seconds']:g} s a phase, B T x {res['pairs']}; "
             f"a LoRA job at ctx {res['ctx']} trains in T. Bound `--max-slowdown-ppm {res['max_slowdown_ppm']}`."),
            "",
            "| pair | baseline tok/s a client | training tok/s a client | requests B/T | p95 ms per token B/T "
            "| job chunks | server ppm | source |",
            "|---:|---:|---:|---|---|---:|---:|---|",
        ]
        for i, p in enumerate(tr["pairs"], 1):
            b, d, j = p["baseline"], p["training"], p["job"]
            lines.append(f"| {i} | {b['tps']:.2f} | {d['tps']:.2f} | {b['requests']}/{d['requests']} "
                         f"| {b['tpt_p95_ms']:.1f}/{d['tpt_p95_ms']:.1f} | {j['chunks']} | {j['slowdown_ppm']} "
                         f"| {j['slowdown_source']} |")
        lines += [
            "",
            (f"Pooled (each answer's `timings`, decoding only): {tr['tps_baseline']:.2f} tok/s a client without "
             f"training, {tr['tps_training']:.2f} with: client slowdown {tr['slowdown_ppm_client']} ppm; the "
             f"server's measure (its steps by batch size) {server} ppm. Bound held: "
             f"**{'yes' if res['training_target_met'] else 'no'}** (client), "
             f"**{'yes' if server is not None and server <= res['max_slowdown_ppm'] else 'no'}** (server)."),
        ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = res["throughput"]["rounds"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for clients, color in ((1, "tab:gray"), (CLIENTS, "tab:blue")):
        xs = [i // 2 + 1 for i, r in enumerate(rounds) if r["clients"] == clients]
        a.plot(xs, [r["tps"] for r in rounds if r["clients"] == clients], "o-", color=color,
               label=f"{clients} client{'s' if clients > 1 else ''}")
    a.set(xlabel="round", ylabel="decode tokens/s", title="aggregate decode tokens/s", ylim=(0, None))
    a.set_xticks(range(1, len(rounds) // 2 + 1))
    a.legend()
    alone = [x for r in rounds if r["clients"] == 1 for g in r["gaps_ms"] for x in g]
    each = [[x for r in rounds if r["clients"] == CLIENTS for x in r["gaps_ms"][i]] for i in range(CLIENTS)]
    b.boxplot([alone, *each], showfliers=False, whis=(5, 95))
    b.set_xticks(range(1, CLIENTS + 2), ["alone"] + [f"client {i + 1}\nof {CLIENTS}" for i in range(CLIENTS)])
    b.set(ylabel="ms per token", title="time per token (whiskers: 5-95%)")
    fig.suptitle(f"remat serve --parallel {CLIENTS}: {res['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure(args: argparse.Namespace) -> dict:
    """Start the server, run the rounds and the training phases; the figures (not yet summed up)."""
    with slow.served(args, "remat-batch-", parallel=CLIENTS) as client:
        questions = slow.prompts()
        run_round(client.port, questions, CLIENTS, 0)  # warm-up
        rounds = []
        for i in range(args.rounds):
            for clients in (1, CLIENTS):
                rounds.append(run_round(client.port, questions, clients, i * CLIENTS))
                print(f"round {i + 1}, {clients} client(s): {rounds[-1]['tps']:.2f} tok/s", file=sys.stderr)
        training = training_under_load(client, client.port, questions, args) if args.pairs else None
        return {"model": client.ok("GET", "/props")["model"], "rounds": rounds, "training": training}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model spec for the server (default: embedded SmolLM2-135M)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one client and of four (default 3)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds per training-under-load phase (default 30)")
    p.add_argument("--pairs", type=int, default=1, help="baseline/training pairs (default 1; 0: skip)")
    p.add_argument("--max-slowdown-ppm", type=int, default=50_000, help="the server's bound (default 50000)")
    p.add_argument("--ctx", type=int, default=64, help="the training job's ctx (default 64)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (default 1)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_batch"))
    args = p.parse_args(argv)
    started, load_start = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    got = measure(args)
    rounds, training = got["rounds"], got["training"]
    one = statistics.median(r["tps"] for r in rounds if r["clients"] == 1)
    four = statistics.median(r["tps"] for r in rounds if r["clients"] == CLIENTS)

    def whole(clients: int) -> float:
        return statistics.median(r["tps_whole"] for r in rounds if r["clients"] == clients)

    res = {
        "model": got["model"], "threads": args.threads, "seconds": args.seconds, "pairs": args.pairs,
        "ctx": args.ctx, "max_slowdown_ppm": args.max_slowdown_ppm,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "elapsed_s": round(time.monotonic() - started, 1),
        "throughput": {"rounds": rounds, "tps_one": round(one, 2), "tps_four": round(four, 2),
                       "ratio": round(four / one, 3), "target_met": four / one >= TARGET,
                       "ratio_whole": round(whole(CLIENTS) / whole(1), 3)},
        "training": training,
        "training_target_met": training is not None and training["slowdown_ppm_client"] <= args.max_slowdown_ppm,
    }
    write_results(Path(args.out), res, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
