"""Decode tokens/s of `remat serve` without training vs during a training job, recompute off and on.

    python -m remat.bench.serve_slowdown                      # default model (embedded SmolLM2-135M), ~5 min
    python -m remat.bench.serve_slowdown --seconds 30 --model tiny-llama --out /tmp/slowdown

Starts one real server (`python -m remat serve`, `--parallel 2`) on a free 127.0.0.1 port with a
temporary state folder and warms it up. Then, for recompute off and on, it runs the phases
baseline, training, baseline, training (B T B T, so that drift of a shared machine hits both):

- baseline: two clients loop greedy chat completions (max_tokens 16) for `--seconds`;
- training: a LoRA job (a few records of the bundled corpus, ctx 64, more steps than it will get) is
  submitted with `recompute` true/false; once it is running and has taken a step, the same client loop
  runs for `--seconds`; then the job is cancelled (POST /train/{id}/cancel) and its report read (GET /train/{id}).

Decode tokens/s is taken from each response's `timings` (predicted_n / predicted_ms: decoding only,
prefill and queueing left out), pooled over a phase. The client slowdown is
(1 - tps_training / tps_baseline) x 1e6 over both pairs of a mode; the server's own figure is the
job's `slowdown_ppm` (the scheduler's measured one). The target: slowdown <= --max-slowdown-ppm.
Writes results.json and results.md into --out (default bench/results/serve_slowdown).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the checkout: bench/results is written there
TERMINAL = ("succeeded", "failed", "cancelled")
MAX_TOKENS = 16
CONCURRENCY = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    def __init__(self, port: int):
        self.port = port

    def request(self, method: str, path: str, body=None, timeout: float = 300) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, text
        finally:
            conn.close()

    def ok(self, method: str, path: str, body=None, status: int = 200):
        got, out = self.request(method, path, body)
        if got != status:
            raise RuntimeError(f"{method} {path}: HTTP {got}: {out}")
        return out


def start_server(args: argparse.Namespace, state_dir: Path, log_path: Path, src: Path = ROOT / "src",
                 parallel: int = CONCURRENCY, extra: list[str] | None = None) -> tuple[subprocess.Popen, Client]:
    """`remat serve` from the checkout whose sources are `src`, ready (its /health answers 200); `extra`: more of
    its flags."""
    port = free_port()
    cmd = [sys.executable, "-m", "remat", "serve", "--port", str(port), "--state-dir", str(state_dir),
           "--parallel", str(parallel), "--max-slowdown-ppm", str(args.max_slowdown_ppm),
           "--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += extra or []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    client = Client(port)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(OSError):
            if client.request("GET", "/health", timeout=5)[0] == 200:
                return proc, client
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready after 300 s:\n{log_path.read_text()}")


def corpus_records(n: int) -> list[dict]:
    from remat.training.data import default_data_path

    lines = default_data_path().read_text().splitlines()
    return [json.loads(line) for line in lines[:n] if line.strip()]


def prompts() -> list[str]:
    out = []
    for rec in corpus_records(60):
        for m in rec.get("messages", []):
            if m.get("role") == "user":
                out.append(m["content"])
                break
    return out or ["Tell me about fine-tuning language models."]


def decode_phase(client: Client, seconds: float, questions: list[str]) -> dict:
    """CONCURRENCY clients loop chat completions for `seconds`; pooled decode timings of the responses."""
    lock = threading.Lock()
    tot: dict[str, Any] = {"requests": 0, "tokens": 0, "predicted_ms": 0.0, "errors": 0, "rates": []}
    counter = iter(range(10**9))
    t0 = time.monotonic()
    deadline = t0 + seconds

    def loop() -> None:
        while time.monotonic() < deadline:
            with lock:
                q = questions[next(counter) % len(questions)]
            body = {"messages": [{"role": "user", "content": q}], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "seed": 0}
            try:
                status, out = client.request("POST", "/v1/chat/completions", body)
            except OSError:
                status, out = 0, None
            with lock:
                if status != 200:
                    tot["errors"] += 1
                    continue
                t = out["timings"]
                tot["requests"] += 1
                tot["tokens"] += t["predicted_n"]
                tot["predicted_ms"] += t["predicted_ms"]
                if t["predicted_ms"] > 0:
                    tot["rates"].append(round(t["predicted_n"] / t["predicted_ms"] * 1e3, 3))

    threads = [threading.Thread(target=loop) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tot["wall_s"] = time.monotonic() - t0
    tot["tps"] = tot["tokens"] / tot["predicted_ms"] * 1e3 if tot["predicted_ms"] else 0.0
    tot["throughput_tps"] = tot["tokens"] / tot["wall_s"]
    return tot


def job(client: Client, recompute: bool, records: list[dict], ctx: int) -> str:
    body = {"data": records, "ctx": ctx, "steps": 100_000, "epochs": 10_000, "recompute": recompute,
            "name": f"slowdown-{'on' if recompute else 'off'}"}
    out = client.ok("POST", "/train", body, status=202)
    job_id = out["id"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # running, past its setup (model load, trace) and first step
        j = client.ok("GET", f"/train/{job_id}")
        if j["status"] in TERMINAL:
            raise RuntimeError(f"training job {job_id} ended before the phase: {j['status']} {j['reason']}")
        if j["status"] == "running" and j["step"] >= 1:
            return job_id
        time.sleep(0.2)
    raise RuntimeError(f"training job {job_id} did not start within 240 s")


def finish_job(client: Client, job_id: str) -> dict:
    status, out = client.request("POST", f"/train/{job_id}/cancel")
    if status not in (200, 409):
        raise RuntimeError(f"POST /train/{job_id}/cancel: HTTP {status}: {out}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        j = client.ok("GET", f"/train/{job_id}")
        if j["status"] in TERMINAL:
            return j
        time.sleep(0.2)
    raise RuntimeError(f"training job {job_id} did not stop within 120 s")


def metrics(client: Client) -> dict:
    status, text = client.request("GET", "/metrics")
    out = {}
    if status == 200 and isinstance(text, str):
        for line in text.splitlines():
            if line.startswith("remat_") and " " in line:
                name, value = line.rsplit(" ", 1)
                with contextlib.suppress(ValueError):
                    out[name.removeprefix("remat_")] = float(value)
    return out


def pooled(phases: list[dict]) -> float:
    ms = sum(p["predicted_ms"] for p in phases)
    return sum(p["tokens"] for p in phases) / ms * 1e3 if ms else 0.0


def ppm(tps_training: float, tps_baseline: float) -> int:
    return round((1 - tps_training / tps_baseline) * 1e6) if tps_baseline else 0


def stderr_ppm(baseline: list[float], training: list[float]) -> int | None:
    """One standard error of the client slowdown, from the spread of the requests' own tokens/s."""
    def rel_var(xs: list[float]) -> float:
        m = statistics.fmean(xs)
        return statistics.variance(xs) / len(xs) / m**2
    if len(baseline) < 2 or len(training) < 2:
        return None
    ratio = statistics.fmean(training) / statistics.fmean(baseline)
    return round(ratio * math.sqrt(rel_var(baseline) + rel_var(training)) * 1e6)


def run_mode(client: Client, recompute: bool, args: argparse.Namespace, questions: list[str],
             records: list[dict]) -> dict:
    pairs = []
    for i in range(args.pairs):
        print(f"recompute {'on' if recompute else 'off'}, pair {i + 1}: baseline", file=sys.stderr)
        base = decode_phase(client, args.seconds, questions)
        print(f"  {base['tps']:.1f} tok/s; submitting a job", file=sys.stderr)
        t0 = time.monotonic()
        job_id = job(client, recompute, records, args.ctx)
        setup_s = time.monotonic() - t0
        before = client.ok("GET", f"/train/{job_id}")
        during = decode_phase(client, args.seconds, questions)
        t0 = time.monotonic()
        j = finish_job(client, job_id)
        cancel_s = time.monotonic() - t0
        print(f"  training: {during['tps']:.1f} tok/s, job {j['status']}, {j['chunks']} chunks, "
              f"server {j['slowdown_ppm']} ppm", file=sys.stderr)
        pairs.append({"baseline": base, "training": during,
                      "job": {k: j.get(k) for k in ("id", "status", "reason", "recompute", "step", "chunks",
                                                    "window_p50", "window_p95", "waited_seconds",
                                                    "slowdown_ppm", "slowdown_source", "measured")},
                      "job_steps_before_phase": before["step"], "job_chunks_before_phase": before["chunks"],
                      "job_setup_s": round(setup_s, 1), "job_cancel_s": round(cancel_s, 1),
                      # chunks that ran after the job's step seen before the phase (its first chunks ran idle)
                      "job_chunks_in_phase": (j["chunks"] or 0) - before["step"],
                      "metrics": metrics(client)})
    tps_b = pooled([p["baseline"] for p in pairs])
    tps_t = pooled([p["training"] for p in pairs])
    jobs = [p["job"] for p in pairs]
    server = [j["slowdown_ppm"] for j in jobs if j["slowdown_ppm"] is not None]
    p50s = [j["window_p50"] for j in jobs if j["window_p50"] is not None]
    p95s = [j["window_p95"] for j in jobs if j["window_p95"] is not None]
    bs = [p["baseline"]["tps"] for p in pairs]
    return {
        "recompute": recompute,
        "tps_baseline": round(tps_b, 2),
        "tps_training": round(tps_t, 2),
        "slowdown_ppm_client": ppm(tps_t, tps_b),
        "slowdown_ppm_server": max(server) if server else None,  # the worse of the jobs
        "window_p50": sorted(p50s)[len(p50s) // 2] if p50s else None,  # the jobs' p50s: their median
        "window_p95": max(p95s) if p95s else None,  # the worse of the jobs
        "chunks": sum(j["chunks"] or 0 for j in jobs),
        "chunks_in_phases": sum(p["job_chunks_in_phase"] for p in pairs),
        "slowdown_ppm_client_stderr": stderr_ppm([x for p in pairs for x in p["baseline"]["rates"]],
                                                 [x for p in pairs for x in p["training"]["rates"]]),
        "job_status": ",".join(j["status"] for j in jobs),
        "baseline_spread_ppm": round((max(bs) - min(bs)) / (sum(bs) / len(bs)) * 1e6) if bs else None,
        "pairs": pairs,
    }


def markdown(res: dict) -> str:
    bound = res["max_slowdown_ppm"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    def mode(r):
        return "on" if r["recompute"] else "off"

    lines = [
        "# Serving slowdown during training",
        "",
        (f"Model `{res['model']}`, `--max-slowdown-ppm {bound}`, `--parallel {CONCURRENCY}`, "
         f"`--threads {res['threads']}`; {CONCURRENCY} clients looping greedy chat completions "
         f"(max_tokens {MAX_TOKENS}) for {res['seconds']:g} s a phase, "
         f"{' '.join(['B T'] * res['pairs'])} per mode (recompute off, then on); a LoRA job at ctx {res['ctx']} "
         "runs in each T phase (it has taken a step before the phase starts) and is cancelled after it."),
        "",
        ("Decode tok/s: the responses' `timings` (predicted_n / predicted_ms: decoding only), pooled over a "
         f"mode's phases. Machine: {res['machine']}, load average {res['loadavg_start']} at the start, "
         f"{res['loadavg_end']} at the end (the machine is shared); {res['elapsed_s']:.0f} s in all."),
        "",
        ("| recompute | baseline tok/s | training tok/s | slowdown ppm (client) | ± 1 SE | slowdown ppm (server) "
         "| window p50 s | window p95 s | chunks (in phases) | job status | baseline spread ppm |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in res["runs"]:
        lines.append(f"| {mode(r)} | {r['tps_baseline']:.2f} | {r['tps_training']:.2f} "
                     f"| {r['slowdown_ppm_client']} | {f(r['slowdown_ppm_client_stderr'], 'd')} "
                     f"| {f(r['slowdown_ppm_server'], 'd')} | {f(r['window_p50'], '.3f')} "
                     f"| {f(r['window_p95'], '.3f')} | {r['chunks']} ({r['chunks_in_phases']}) "
                     f"| {r['job_status']} | {r['baseline_spread_ppm']} |")
    lines += [
        "",
        (f"Target (client-measured slowdown <= {bound} ppm in every mode): "
         f"**{'met' if res['target_met'] else 'not met'}**; by the server's own per-job measure: "
         f"**{'met' if res['target_met_server'] else 'not met'}**. The server's slowdown over its whole life "
         f"(`/metrics` at the end, all jobs and phases): {f(res['metrics'].get('slowdown_ppm'), '.0f')} ppm."),
        "",
        ("Client slowdown: (1 - training / baseline tok/s) x 1e6; ± 1 SE from the spread of the requests' own "
         "tok/s (it leaves out drift between phases: see the baseline spread, how far a mode's baseline phases "
         "differ from each other). Server slowdown and window p95: the worse of a mode's jobs; window p50: the "
         "median of its jobs' p50s (a window is a chunk's wall time: one optimizer step here). Chunks: all of a "
         "mode's jobs' chunks; in parentheses those that ran after the phase began."),
        "",
        "Per phase:",
        "",
        ("| recompute | pair | baseline tok/s | training tok/s | requests B/T | job setup s | job steps "
         "| chunks in phase | window p50 s | window p95 s | server ppm | source |"),
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["runs"]:
        for i, p in enumerate(r["pairs"], 1):
            j = p["job"]
            lines.append(f"| {mode(r)} | {i} | {p['baseline']['tps']:.2f} | {p['training']['tps']:.2f} "
                         f"| {p['baseline']['requests']}/{p['training']['requests']} | {p['job_setup_s']:.0f} "
                         f"| {j['step']} | {p['job_chunks_in_phase']} | {f(j['window_p50'], '.3f')} "
                         f"| {f(j['window_p95'], '.3f')} | {j['slowdown_ppm']} | {j['slowdown_source']} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def served(args: argparse.Namespace, prefix: str, parallel: int = CONCURRENCY) -> Iterator[Client]:
    """A `remat serve` of its own (`start_server`) in a temporary folder, for the block's measurements: on a failure
    the end of its log is printed; it is stopped and its folder removed either way."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    log_path = tmp / "server.log"
    proc = None
    try:
        proc, client = start_server(args, tmp / "state", log_path, parallel=parallel)
        yield client
    except BaseException:
        if log_path.exists():
            print(log_path.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(args: argparse.Namespace, started: float) -> tuple[list[dict], str, dict]:
    """One server: decode alone and beside a training job, for each mode; its runs, model and final metrics."""
    with served(args, "remat-slowdown-") as client:
        print(f"server ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
        questions = prompts()
        records = corpus_records(8)
        decode_phase(client, min(5.0, args.seconds), questions)  # warm-up
        runs = [run_mode(client, recompute, args, questions, records) for recompute in (False, True)]
        return runs, client.ok("GET", "/props")["model"], metrics(client)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model spec for the server (default: embedded SmolLM2-135M)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--pairs", type=int, default=2, help="baseline/training pairs per mode (default 2)")
    p.add_argument("--max-slowdown-ppm", type=int, default=50_000, help="the server's bound (default 50000)")
    p.add_argument("--ctx", type=int, default=64, help="the training job's ctx (default 64)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (default 1)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_slowdown"))
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))

    started = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    runs, model, final_metrics = _measure(args, started)
    bound = args.max_slowdown_ppm
    res = {
        "model": model,
        "max_slowdown_ppm": bound,
        "seconds": args.seconds,
        "pairs": args.pairs,
        "ctx": args.ctx,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(time.monotonic() - started, 1),
        "runs": runs,
        "metrics": final_metrics,
        "target_met": all(r["slowdown_ppm_client"] <= bound for r in runs),
        "target_met_server": all(r["slowdown_ppm_server"] is not None and r["slowdown_ppm_server"] <= bound
                                 for r in runs),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
