"""What the benches against remat's peers share: one training run in a child process, measured from outside.

Every side runs as its own process and is measured the same way: the kernel's peak resident set of that child
(`os.wait4`'s `ru_maxrss`: weights, optimizer state, activations, the runtime, all of it) and its wall time.
remat's side is `python -m remat finetune --json` (its receipt beside); Hugging Face + PEFT's is
`python -m remat.bench.peers hf ...`, below: the same random-weight preset or GGUF loaded by `remat.models.load`
(float32 on both sides), PEFT's LoRA with remat's default adapter (or every weight with `--full`),
`gradient_checkpointing_enable()` (non-reentrant), the model's own loss (`labels=`), `loss.backward()` and
`torch.optim.AdamW`: what a Hugging Face user runs. `longest_window` and `train_peers` build on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the checkout: bench/results is written there
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "seven", "table", "light", "north",
         "paper", "quick", "sound")


@dataclass
class ChildRun:
    cmd: list[str]
    rc: int
    peak_rss: int  # bytes: the child's peak resident set (ru_maxrss)
    seconds: float
    stdout: str
    stderr: str

    def error(self) -> str:
        """The child's last stderr line that is not the wrapper's peak."""
        lines = [ln for ln in self.stderr.strip().splitlines() if not ln.startswith("peak_rss=")]
        return (lines[-1] if lines else f"exit {self.rc}")[:300]

    def json(self) -> dict:
        """The child's last stdout line as JSON ({} when it printed none)."""
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {}


def run_child(cmd: list[str], *, timeout: float | None = None, env: dict | None = None) -> ChildRun:
    """Run `cmd`, wait for it, and return its exit status, peak resident set and wall time."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    t0 = time.perf_counter()
    with open(os.devnull) as null:
        proc = subprocess.Popen(cmd, stdin=null, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, cwd=ROOT)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n(killed after {timeout} s)"
    seconds = time.perf_counter() - t0
    return ChildRun(cmd, proc.returncode, _reported_peak(err), seconds, out, err)


def _reported_peak(stderr: str) -> int:
    """The peak `PEAK_WRAPPER` reported on its last `peak_rss=` stderr line (0: none)."""
    for line in reversed(stderr.splitlines()):
        if line.startswith("peak_rss="):
            return int(line.split("=", 1)[1])
    return 0


PEAK_WRAPPER = ("import os,resource,subprocess,sys;p=subprocess.Popen(sys.argv[1:]);_,st,ru=os.wait4(p.pid,0);"
                "print(f'peak_rss={ru.ru_maxrss*1024}',file=sys.stderr);sys.exit(os.waitstatus_to_exitcode(st))")


def measured(cmd: list[str], *, timeout: float | None = None, env: dict | None = None) -> ChildRun:
    """`run_child` of `cmd` under a small wrapper that reaps it with `os.wait4` and reports its own peak resident
    set: the same measure for a Python child and for llama.cpp's binary."""
    return run_child([sys.executable, "-c", PEAK_WRAPPER, *cmd], timeout=timeout, env=env)


def text_file(path: Path, words: int = 200_000, seed: int = 0) -> Path:
    """A text file of random words: `remat finetune --pack` windows of any length, and llama.cpp's training text."""
    if not path.exists():
        r = random.Random(seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(r.choice(WORDS) for _ in range(words)))
    return path


def remat_cmd(model: str | None, ctx: int, *, lora: bool, steps: int, data: Path, extra: tuple[str, ...] = ()
              ) -> list[str]:
    """`remat finetune` of `steps` steps on packed windows of `data`, one JSON receipt on stdout; computing in
    float32 as the peers do (`--dtype auto` is bfloat16 on a CPU with AVX512-BF16), unless `extra` says."""
    cmd = [sys.executable, "-m", "remat", "finetune", "--ctx", str(ctx), "--steps", str(steps), "--pack",
           "--data", str(data), "--json", "--dtype", "float32", *extra]
    if model:
        cmd += ["--model", model]
    return cmd + ([] if lora else ["--full"])


def hf_cmd(model: str | None, ctx: int, *, lora: bool, steps: int) -> list[str]:
    """The Hugging Face + PEFT side's child (`main` below)."""
    cmd = [sys.executable, "-m", "remat.bench.peers", "--ctx", str(ctx), "--steps", str(steps)]
    if model:
        cmd += ["--model", model]
    return cmd + ([] if lora else ["--full"])


def machine() -> str:
    import torch
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); load average at the start {os.getloadavg()[0]:.1f}")


# ------------------------------------------------------------------------------ the Hugging Face + PEFT child


def hf_train(model: str | None, ctx: int, *, lora: bool, steps: int, lr: float, seed: int = 0) -> dict:
    """Train `steps` steps of Hugging Face + PEFT with gradient checkpointing on random tokens; time each step."""
    import torch

    from remat.bench.common import random_batches
    from remat.core.process import process_peak, reset_process_peak
    from remat.models import adapters
    from remat.models import load as models

    try:
        loaded = models.load_model(model, seed=seed, as_stored=False)  # float32, as transformers loads a GGUF
        m: Any = loaded.model
        name = loaded.name
    except models.ModelError:  # a plan-only preset (remat does not train it): transformers builds it from its config
        m = models.build_from_config(models.load_config(model), seed=seed)
        name = f"{model} (built from its config)"
    if lora:
        m = adapters.apply_lora(m, adapters.LoraSettings(), seed=seed)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    # Building a preset from its config (transformers' init) can peak above what training holds at a short window:
    # the peaks of the two phases apart, so that a fit sees training's growth with the window.
    load_peak = process_peak().get("rss")
    reset_process_peak()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    seconds, losses = [], []
    for ids, _ in random_batches(m.config.vocab_size, 1, ctx, steps, seed):
        t0 = time.perf_counter()
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss  # the model's own shifted cross-entropy
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = seconds[1:] or seconds  # the first step is the warm-up
    return {"model": name, "ctx": ctx, "lora": lora, "trainable_parameters": sum(p.numel() for p in params),
            "dtype": str(next(m.parameters()).dtype), "attention": m.config._attn_implementation,
            "step_seconds_all": seconds, "losses": losses,
            "tokens_per_second": ctx * len(timed) / sum(timed), "load_peak_rss": load_peak,
            "train_peak_rss": process_peak().get("rss")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remat.bench.peers",
                                description="one Hugging Face + PEFT training run (gradient checkpointing), JSON out")
    p.add_argument("--model", default=None)
    p.add_argument("--ctx", type=int, required=True)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--full", action="store_true", help="every weight trains (default: remat's LoRA adapter)")
    p.add_argument("--lr", type=float, default=None)
    a = p.parse_args(argv)
    lr = a.lr if a.lr is not None else (1e-4 if a.full else 1e-3)  # remat's defaults
    print(json.dumps(hf_train(a.model, a.ctx, lora=not a.full, steps=a.steps, lr=lr)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
