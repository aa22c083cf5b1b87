"""`remat bench`: remat with recompute off and on, PyTorch's own per-layer checkpointing, and plain eager.

The variants train side by side in one process, on the same data from the same initial
weights (with `--lora`, the same initial adapter), each with its own copy of the model and its
own AdamW:

- `remat_off`: the traced step (`Planner.build`), recompute off, run as `train.BatchRunner` runs it
  (on the walk path, the walk of `--walk`: exact by default);
- `remat_on`: the same, recompute on;
- `torch_checkpoint`: the Hugging Face model trained eagerly with its per-decoder-layer
  `torch.utils.checkpoint` (non-reentrant), unchunked loss, `loss.backward()`;
- `eager`: the same without checkpointing;
- on the walk path only, two more, recompute on: `remat_on_truncated` (the truncated walk, same
  chunks: earlier chunks' K/V are constants) and `remat_on_window` (the window path, same ctx).

Steps are interleaved (A B C D [E F], A B C D [E F], ...) so that drift of the machine hits all
variants alike. The first step of each variant is the warm-up (for remat it also traces) and is
left out of the step time; it is also the step whose memory is measured, the same way for
all: every byte the allocator hands out or takes back while forward and backward run
(the grads included), as a running sum from the start of the step, and its peak.
On CPU that is the profiler's allocation events, on CUDA `max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from remat.base.settings import MiB, TrainSettings, UsageError
from remat.bench.common import (
    Variant,
    eager_variant,
    mib,
    random_batches,
    remat_variant,
    run_step,
    secs,
    training,
    x,
)
from remat.core.process import reuse_freed_memory
from remat.models import adapters
from remat.models import load as models
from remat.training import gate

VARIANTS = ("remat_off", "remat_on", "torch_checkpoint", "eager")
WALK_VARIANTS = ("remat_on_truncated", "remat_on_window")  # the walk path's two more
LABELS = {"remat_off": "A", "remat_on": "B", "torch_checkpoint": "C", "eager": "D", "remat_on_truncated": "E",
          "remat_on_window": "F"}
TIME_TARGET_SLACK = 1.05  # B/A step time at most 5% above C/D's
TIME_TARGET_CPU = 1.35  # and at most 1.35 on CPU
WALK_TIME_TARGET = 1.5  # the exact walk's step time at most 1.5 times the truncated walk's
WALK_LOSS_RTOL = 1e-5  # the exact walk's losses vs the window's, relative, per step


def variant_names(path: str) -> tuple[str, ...]:
    """The variants a bench on this path runs, in their interleaved order."""
    return VARIANTS + WALK_VARIANTS if path == "walk" else VARIANTS

def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def run_bench(model: str | None, ctx: int, batch: int = 1, steps: int = 3, path: str = "window",
              ubatch: int = 256, loss_chunk: int | None = None,
              out: str | Path | None = None, lr: float = 1e-4, *, walk: str = "exact", lora: bool = False,
              seed: int = 0, progress: bool = True) -> dict:
    """Train the variants side by side for `steps` steps; write bench.json/.md/.png into `out`.

    `lora`: every variant trains the same LoRA adapter (remat's defaults, r 8) from the same init; else
    full fine-tuning."""
    if steps < 2:
        raise UsageError(f"--steps must be at least 2 (the first step is the warm-up), got {steps}")
    s = TrainSettings(model=model, ctx=ctx, batch=batch, steps=steps, lr=lr, seed=seed, loss_chunk=loss_chunk,
                      path=path, ubatch=ubatch, walk=walk, lora=lora,
                      dtype="float32")  # the variants beside remat's (eager, torch's checkpointing) are float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def say(text: str) -> None:
        if progress:
            print(f"bench: {text}", file=sys.stderr, flush=True)

    reuse_freed_memory()  # as the trainer does: the process peaks follow what is live
    loaded = models.load_model(model, seed=seed, as_stored=lora)  # full fine-tuning trains float32 weights
    models.check_ctx(ctx, loaded.model.config)
    s = gate.settled(s, loaded.model.config)  # the loss chunk the trainer would choose
    variants = _variants(loaded.model.to(device), s)  # type: ignore[arg-type]  # transformers types .to oddly
    data = [tuple(t.to(device) for t in b) for b in random_batches(loaded.model.config.vocab_size, batch, ctx,
                                                                    steps, seed)]
    say(f"{loaded.name}, ctx {ctx}, batch {batch}, path {s.path}" + (f" ({s.walk} walk)" if s.path == "walk" else "")
        + f", {'LoRA r' + str(s.lora_r) if lora else 'full'}, {steps} steps on {device.type}")
    # Off CPU, tensors a step makes without a device (traced example inputs, walk offsets) must land on
    # the device; on CPU the device context is left out, as it costs a Python call on every op.
    with contextlib.nullcontext() if device.type == "cpu" else torch.device(device):
        for i, (input_ids, labels) in enumerate(data):
            for v in variants:
                run_step(v, input_ids, labels, device, warm_up=i == 0)
                say(f"step {i + 1}/{steps} {v.name:<18} loss {v.losses[-1]:.6f}  {v.seconds[-1]:.2f} s"
                    + ("  (warm-up)" if i == 0 else ""))
    result = _result(loaded, s, device, [v.result() for v in variants])
    if out is not None:
        write_outputs(result, Path(out))
    return result


def _variants(base: nn.Module, s: TrainSettings) -> list[Variant]:
    """Every variant of the bench on `s`'s path, each on its own copy of `base` (the same initial weights; with
    LoRA, the same initial adapter) with its own AdamW."""
    names = variant_names(s.path)
    copies = [base] + [copy.deepcopy(base) for _ in names[1:]]  # the same initial weights, before any use
    if s.lora:  # the same seed: every variant starts from the same adapter
        copies = [adapters.apply_lora(m, adapters.LoraSettings(), seed=s.seed) for m in copies]
    variants = [
        remat_variant("remat_off", copies[0], s, False),
        remat_variant("remat_on", copies[1], s, True),
        eager_variant("torch_checkpoint", copies[2], True),
        eager_variant("eager", copies[3], False),
    ]
    if s.path == "walk":
        variants += [
            remat_variant("remat_on_truncated", copies[4], s.model_copy(update={"walk": "truncated"}), True),
            remat_variant("remat_on_window", copies[5], s.model_copy(update={"path": "window"}), True),
        ]
    assert [v.name for v in variants] == list(names)
    for v in variants:
        v.optimizer = torch.optim.AdamW(v.params, lr=s.learning_rate, weight_decay=0.0)
    return variants


def _result(loaded: models.LoadedModel, s: TrainSettings, device: torch.device, results: list[dict]) -> dict:
    walk = s.path == "walk"
    result = {
        "model": loaded.name, "ctx": s.ctx, "batch": s.batch, "path": s.path,
        "ubatch": s.ubatch if walk else None, "walk": s.walk if walk else None,
        "lora": s.lora_r if s.lora else None,  # the adapter's rank; None: full fine-tuning
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "loss_chunk": s.loss_chunk, "steps": s.steps, "lr": s.learning_rate,
        "device": device.type if device.type == "cpu" else f"cuda ({torch.cuda.get_device_name(device)})",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "data": f"random tokens, seed {s.seed}",
        "variants": results,
    }
    return result | summarize(result, device.type)


def _max_rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)), default=0.0)


def summarize(result: dict, device_type: str = "cpu") -> dict:
    """Ratios, loss equality and the targets, from the variants' results."""
    by = {v["variant"]: v for v in result["variants"]}
    a, b, c, d = (by[n] for n in VARIANTS)
    ratios = {
        "memory_on_over_off": _ratio(b["measured_peak"], a["measured_peak"]),
        "memory_checkpoint_over_eager": _ratio(c["measured_peak"], d["measured_peak"]),
        "memory_on_over_checkpoint": _ratio(b["measured_peak"], c["measured_peak"]),
        "planned_graph_on_over_off": _ratio(b["planned_graph"], a["planned_graph"]),
        "time_on_over_off": _ratio(b["step_seconds"], a["step_seconds"]),
        "time_checkpoint_over_eager": _ratio(c["step_seconds"], d["step_seconds"]),
        "time_on_over_checkpoint": _ratio(b["step_seconds"], c["step_seconds"]),
    }
    bitwise = len(a["losses"]) == len(b["losses"]) and all(
        float(x).hex() == float(y).hex() for x, y in zip(a["losses"], b["losses"]))
    losses = {
        "on_equals_off_bitwise": bitwise,
        "on_vs_off_max_abs_diff": _max_abs_diff(b["losses"], a["losses"]),
        "checkpoint_vs_eager_max_abs_diff": _max_abs_diff(c["losses"], d["losses"]),
        "off_vs_eager_max_abs_diff": _max_abs_diff(a["losses"], d["losses"]),
    }
    t_on, t_ckpt = ratios["time_on_over_off"], ratios["time_checkpoint_over_eager"]
    targets = {
        "peak_on_le_checkpoint": b["measured_peak"] <= c["measured_peak"],
        "time_ratio_le_checkpoint_ratio_x1.05": t_on is not None and t_ckpt is not None
        and t_on <= t_ckpt * TIME_TARGET_SLACK,
        "losses_on_equal_off_bitwise": bitwise,
    }
    if device_type == "cpu":
        targets["time_ratio_le_1.35"] = t_on is not None and t_on <= TIME_TARGET_CPU
    if all(n in by for n in WALK_VARIANTS):  # the walk path: B walks, E the truncated walk, F the window
        e, f = by["remat_on_truncated"], by["remat_on_window"]
        ratios["memory_on_over_window_on"] = _ratio(b["measured_peak"], f["measured_peak"])
        ratios["time_on_over_truncated"] = _ratio(b["step_seconds"], e["step_seconds"])
        t_walk = ratios["time_on_over_truncated"]
        rel = _max_rel_diff(b["losses"], f["losses"])
        losses["walk_vs_window_max_rel_diff"] = rel
        losses["truncated_vs_window_max_rel_diff"] = _max_rel_diff(e["losses"], f["losses"])
        match = len(b["losses"]) == len(f["losses"]) and rel <= WALK_LOSS_RTOL
        losses["walk_losses_match_window"] = match
        targets |= {
            "walk_peak_le_window_on": b["measured_peak"] <= f["measured_peak"],
            "walk_time_le_1.5x_truncated": t_walk is not None and t_walk <= WALK_TIME_TARGET,
            "walk_losses_match_window": match,
        }
    return {"ratios": ratios, "loss_equality": losses, "targets": targets}


# ---------------------------------------------------------------------------------------- outputs


def _walk_label(result: dict) -> str:
    return f"{result['walk']} walk" if result.get("walk") else "walk"


def title(result: dict) -> str:
    walk = f", {_walk_label(result)} in chunks of {result['ubatch']}" if result["path"] == "walk" else ""
    return (f"{result['model']}, ctx {result['ctx']}, batch {result['batch']}, path {result['path']}{walk}, "
            f"{training(result)}, {result['device']}")


def markdown(result: dict) -> str:
    r = result["ratios"]
    lines = [
        f"# remat bench: {title(result)}",
        "",
        (f"{result['steps']} steps per variant, interleaved; step time is the median wall time after the "
        f"first (warm-up) step; {result['data']}; torch {result['torch']}, {result['threads']} threads."),
        "",
        *_variant_table(result),
        "",
        (f"remat_on vs torch_checkpoint: memory {x(r['memory_on_over_checkpoint'])}, "
        f"time {x(r['time_on_over_checkpoint'])}."),
    ]
    if all(n in {v["variant"] for v in result["variants"]} for n in WALK_VARIANTS):
        lines += [
            "",
            (f"remat_on ({_walk_label(result)}) vs remat_on_window: memory {x(r['memory_on_over_window_on'])}; "
             f"vs remat_on_truncated: time {x(r['time_on_over_truncated'])}."),
        ]
    lines += [*_loss_lines(result), "",
              "Targets: " + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in result["targets"].items()) + ".",
              "", _measured_note(result)]
    return "\n".join(lines) + "\n"


def _variant_table(result: dict) -> list[str]:
    r = result["ratios"]
    versus = {"remat_on": ("vs remat_off", r["memory_on_over_off"], r["time_on_over_off"]),
              "torch_checkpoint": ("vs eager", r["memory_checkpoint_over_eager"], r["time_checkpoint_over_eager"])}
    lines = [("| variant | loss | planned graph MiB | measured peak MiB | remat measured graph MiB | process peak MiB "
              "| step s | memory ratio | time ratio |"),
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for v in result["variants"]:
        name = v["variant"]
        against, mem, t = versus.get(name, ("", None, None))
        lines.append(f"| {LABELS[name]} `{name}` | {v['loss']} | {mib(v['planned_graph'])} "
                     f"| {mib(v['measured_peak'])} | {mib(v['measured_graph'])} | {mib(v.get('process_peak'))} "
                     f"| {secs(v['step_seconds'])} "
                     f"| {x(mem) + ' ' + against if mem is not None else '–'} "
                     f"| {x(t) + ' ' + against if t is not None else '–'} |")
    return lines


def _loss_lines(result: dict) -> list[str]:
    le = result["loss_equality"]
    by = {v["variant"]: v for v in result["variants"]}
    verdict = "bitwise equal" if le["on_equals_off_bitwise"] else \
        f"NOT bitwise equal (max abs diff {le['on_vs_off_max_abs_diff']:.3g})"
    if result["path"] != "walk":
        why = "chunked vs unchunked loss"
    elif result.get("walk") == "truncated":
        why = "the truncated walk's gradient treats earlier chunks' K/V as constants"
    else:
        why = "the exact walk: chunked loss and attention, the window's gradient"
    lines = ["", (f"Losses: remat_on vs remat_off {verdict} over {len(by['remat_on']['losses'])} steps; "
                  f"torch_checkpoint vs eager max abs diff {le['checkpoint_vs_eager_max_abs_diff']:.3g} "
                  f"(remat_off vs eager {le['off_vs_eager_max_abs_diff']:.3g}: {why}).")]
    if all(n in by for n in WALK_VARIANTS):
        match = "within" if le["walk_losses_match_window"] else "NOT within"
        lines += ["", (f"Walk vs window: remat_on ({_walk_label(result)}) vs remat_on_window max relative diff "
                       f"{le['walk_vs_window_max_rel_diff']:.3g} per step, {match} {WALK_LOSS_RTOL:g}. The truncated "
                       f"walk's first loss is the window's (the same forward), its later losses differ (max relative "
                       f"diff {le['truncated_vs_window_max_rel_diff']:.3g}): its gradient is another one (earlier "
                       "chunks' K/V are constants for a chunk's backward).")]
    return lines


def _measured_note(result: dict) -> str:
    return ("Measured peak: bytes allocated above the step's start while forward and backward run (grads "
        "included, optimizer not), the same way for all variants "
        + ("(profiler allocation events)" if result["device"] == "cpu" else "(`torch.cuda.max_memory_allocated`)")
        + "; planned graph: remat's plan of the graph alone (no grads)"
        + ("; on the walk path the measured peak includes the KV cache (the exact walk's also its gradient "
           "buffers and the chunks' start states) and the window's gradient sums, which every chunk adds into "
           "(one set of grads)." if result["path"] == "walk" else ".")
        + " Process peak: the process's peak resident set (VmHWM, reset before each timed step) above its "
        "resident set at the step's start, optimizer update included; the most over the timed steps. The start is "
        "taken after a garbage collection and glibc's `malloc_trim(0)` have given the heap that earlier steps (the "
        "other variants') freed back to the kernel, so it is what is live and the figure is the step's own; it "
        "also counts what the allocator does not (page rounding, the heap's fragments, non-tensor memory the "
        "step touches again). The heap is still shared: a step whose blocks land in the holes other variants "
        "left (returned, so counted again when touched) can read above what it takes in a process of its own."
        " C and D run the whole window eagerly with the unchunked loss, as Hugging Face users get it "
        "(the attention is the same SDPA kernel remat traces).")


def plot(result: dict, dest: Path) -> bool:
    """Memory vs step time, one labelled point per variant; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"remat_off": "tab:blue", "remat_on": "tab:green", "torch_checkpoint": "tab:orange",
              "eager": "tab:red", "remat_on_truncated": "tab:purple", "remat_on_window": "tab:brown"}
    fig, ax = plt.subplots(figsize=(7, 4.8), dpi=120)
    for v in result["variants"]:
        x, y = v["step_seconds"], v["measured_peak"] / MiB
        letter = LABELS[v["variant"]]
        ax.scatter([x], [y], s=70, color=colors[v["variant"]], zorder=3,
                   label=f"{letter} {v['variant']}: {y:,.0f} MiB, {x:.2f} s")
        ax.annotate(letter, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=10, fontweight="bold")
    xs = [v["step_seconds"] for v in result["variants"]]
    ys = [v["measured_peak"] / MiB for v in result["variants"]]
    ax.set_xlim(0, max(xs) * 1.35)
    ax.set_ylim(0, max(ys) * 1.2)
    ax.set_xlabel("step time, s (median after warm-up)")
    ax.set_ylabel("measured activation peak, MiB")
    ax.set_title(title(result), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=9, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(dest, format="png")
    plt.close(fig)
    return True


def write_outputs(result: dict, out: Path, render: Callable[[dict], str] | None = None,
                  draw: Callable[[dict, Path], bool] | None = None) -> list[str]:
    """bench.json, bench.md (`render`, default this bench's `markdown`) and bench.png (`draw`: `plot`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text((render or markdown)(result))
    written = [str(out / "bench.json"), str(out / "bench.md")]
    if (draw or plot)(result, out / "bench.png"):
        written.append(str(out / "bench.png"))
    else:
        print("bench: matplotlib is not installed (pip install 'remat[bench]'): no bench.png", file=sys.stderr)
    return written


def _summary_row(name: str, r: dict) -> tuple[str, str | None]:
    """A run's row of the summary table, and its walk line (walk runs)."""
    by = {v["variant"]: v for v in r["variants"]}
    walk = None
    ra, le, tg = r["ratios"], r["loss_equality"], r["targets"]
    setting = f"{r['model']} ctx {r['ctx']} b{r['batch']} {r['path']}" + \
        (f" {r['ubatch']}" + (f" {r['walk']}" if r.get("walk") else "") if r["path"] == "walk" else "") + \
        f" {training(r)}"
    if all(n in by for n in WALK_VARIANTS):
        e, w = by["remat_on_truncated"], by["remat_on_window"]
        walk = (
            f"- [{name}]({name}/bench.md): E `remat_on_truncated` {mib(e['measured_peak'])} "
            f"MiB, {secs(e['step_seconds'])} s; F `remat_on_window` {mib(w['measured_peak'])} MiB, "
            f"{secs(w['step_seconds'])} s; mem B/F {x(ra.get('memory_on_over_window_on'))}, "
            f"time B/E {x(ra.get('time_on_over_truncated'))}; B's losses match F's within {WALK_LOSS_RTOL:g}: "
            f"{'yes' if le.get('walk_losses_match_window') else 'NO'}.")
    row = (
        f"| [{name}]({name}/bench.md) | {setting} "
        + "".join(f"| {mib(by[n]['measured_peak'])} " for n in VARIANTS)
        + "".join(f"| {secs(by[n]['step_seconds'])} " for n in VARIANTS)
        + f"| {x(ra['memory_on_over_off'])} | {x(ra['memory_checkpoint_over_eager'])} "
        f"| {x(ra['memory_on_over_checkpoint'])} | {x(ra['time_on_over_off'])} "
        f"| {x(ra['time_checkpoint_over_eager'])} | {'yes' if le['on_equals_off_bitwise'] else 'NO'} "
        f"| {sum(tg.values())}/{len(tg)} |"
    )
    return row, walk


def write_summary(results_dir: str | Path) -> Path:
    """One table over every `*/bench.json` under `results_dir`, written to `results_dir/README.md`."""
    root = Path(results_dir)
    rows, walks = [], []
    for f in sorted(root.glob("*/bench.json")):
        r = json.loads(f.read_text())
        if r.get("sweep"):  # a Pareto sweep (remat.bench.sweep): its own receipt, not this table's variants
            continue
        row, walk = _summary_row(f.parent.name, r)
        rows.append(row)
        walks += [walk] if walk else []
    first = json.loads(next(root.glob("*/bench.json")).read_text()) if rows else {}
    text = "\n".join([
        "# remat bench results",
        "",
        ("Regenerate with `bench/run_all.sh`. A = `remat_off`, B = `remat_on` (remat, recompute off / on), "
        "C = `torch_checkpoint` (Hugging Face model, per-layer `torch.utils.checkpoint`), D = `eager` "
        "(no checkpointing). Peaks are measured activation peaks in MiB (bytes allocated during forward + "
        "backward above the step's start, grads included, measured the same way for all four); times are "
        "median seconds per training step after a warm-up step. C and D use the plain unchunked loss."),
        "",
        (f"Machine: {first.get('device', '?')}, {first.get('threads', '?')} threads, torch {first.get('torch', '?')}; "
         f"{platform.machine()}.") if rows else "No results yet.",
        "",
        ("| run | setting | A peak | B peak | C peak | D peak | A s | B s | C s | D s | mem B/A | mem C/D "
        "| mem B/C | time B/A | time C/D | B == A bitwise | targets met |"),
        "|---|---|" + "---:|" * 8 + "---:|" * 5 + "---|---|",
        *rows,
        "",
        ("Targets per run: B's peak ≤ C's; B/A time ≤ C/D time × 1.05; B/A time ≤ 1.35 (CPU); "
        "B's losses bitwise equal to A's. Each run's folder has bench.json, bench.md and bench.png."),
        *(["",
           ("Walk runs (A and B walk as the run's walk says, exact by default), two more variants, recompute on: "
            "E = `remat_on_truncated` (the truncated walk, same chunks), F = `remat_on_window` (the window path, "
            "same ctx). Their targets: B's peak ≤ F's (≤ C's is the first target above); B/E time ≤ 1.5; "
            f"B's losses within {WALK_LOSS_RTOL:g} relative of F's per step (the truncated walk's later losses "
            "differ: its gradient is another one)."),
           "",
           *walks] if walks else []),
    ])
    dest = root / "README.md"
    dest.write_text(text + "\n")
    return dest


# ---------------------------------------------------------------------------------------- command line


def main(args: argparse.Namespace) -> int:
    result = run_bench(args.model, args.ctx, args.batch, args.steps, args.path, args.ubatch, args.loss_chunk,
                       args.out, args.lr, walk=args.walk, lora=args.lora)
    print(json.dumps(result) if args.json else markdown(result) + f"\nwritten to {args.out}/")
    return 0
