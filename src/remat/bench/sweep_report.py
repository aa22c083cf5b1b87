"""`remat bench --sweep`'s receipt: the Markdown table with its targets, and the memory-against-time plot."""

from __future__ import annotations

from pathlib import Path

from remat.base.settings import MiB
from remat.bench import compare as bench
from remat.bench.common import mib, secs, training, x

# the sweep's targets, checked by `sweep.summarize` and said here
TIME_TARGET_HALFWAY = 1.05  # (a) at the budget halfway between layer and off: step time <= 1.05 x off
GRAPH_TARGET = 0.6  # (b) every:4 (or the smallest budget point) plans <= 0.6 x layer's graph

def title(result: dict) -> str:
    return f"{result['model']}, ctx {result['ctx']}, batch {result['batch']}, {training(result)}, {result['device']}"


def _table(result: dict) -> list[str]:
    lines = ["| variant | kind | policy | budget MiB | planned total MiB | planned graph MiB | measured graph MiB "
             "| measured peak MiB | step s med | step s min | time / off (median) | time / off (min) | loss == off |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v in result["variants"]:
        same = "bitwise" if v["losses_equal_off_bitwise"] else f"max diff {v['loss_max_abs_diff_vs_off']:.3g}"
        lines.append(f"| `{v['variant']}` | {v['kind']} | {v['policy'] or '–'} | {mib(v['budget'])} "
                     f"| {mib(v['planned_total'])} | {mib(v['planned_graph'])} | {mib(v['measured_graph'])} "
                     f"| {mib(v['measured_peak'])} | {secs(v['step_seconds'])} | {secs(v['step_seconds_min'])} "
                     f"| {x(v['time_ratio'])} | {x(v['time_ratio_min'])} | {same} |")
    return lines


def _target_lines(result: dict) -> list[str]:
    by = {v["variant"]: v for v in result["variants"]}
    tg, half = result["targets"], by.get(result["halfway"] or "")

    def verdict(key: str) -> str:
        return "**met**" if tg[key] else "**NOT met**"

    graphs = ", ".join(f"{n} {r:.3f}×" for n, r in result["graph_over_layer"].items())
    lines = [
        "## Targets, as measured",
        "",
        (f"- (a) at the budget halfway between `layer` and `off` ({mib(half and half['budget'])} MiB, "
         f"`{result['halfway']}`, chose `{half and half['policy']}`) step time ≤ {TIME_TARGET_HALFWAY} × off: "
         f"{x(half and half['time_ratio'])}, {verdict('a_halfway_time_le_1.05')}."),
        (f"- (b) `every:4` (or the smallest budget point) plans ≤ {GRAPH_TARGET} × `layer`'s graph: {graphs}, "
         f"{verdict('b_graph_le_0.6_layer')}."),
        ("- (c) at every AOT budget remat is no slower than AOTAutograd at the same measured memory (remat's "
         "fastest point with measured peak ≤ AOT's; beside it, remat's frontier interpolated at AOT's peak, for "
         f"reference): {verdict('c_remat_no_slower_than_aot')}."),
    ]
    for r in result["versus_aot"]:
        remat = (f"`{r['remat']}` {mib(r['remat_peak'])} MiB, {x(r['remat_time_ratio'])}" if r["remat"]
                 else "no remat point at or below that memory")
        lines.append(f"  - `{r['aot']}` {mib(r['aot_peak'])} MiB, {x(r['aot_time_ratio'])} vs {remat} "
                     f"(interpolated {x(r['remat_interpolated_time_ratio'])}): {'met' if r['met'] else 'NOT met'}")
    lines.append(f"- remat's losses equal off's bitwise, every variant and step: "
                 f"{verdict('remat_losses_equal_off_bitwise')} (grads bitwise too: "
                 f"{'yes' if result['loss_equality']['remat_grads_equal_off_bitwise'] else 'NO'}).")
    return lines


def markdown(result: dict) -> str:
    refused = [f"`{r['variant']}` ({mib(r['budget'])} MiB)" for r in result["refused"]]
    lines = [
        f"# remat bench --sweep: {title(result)}",
        "",
        (f"{result['steps']} rounds, round-robin over the variants (off first); round 0 is the warm-up and the "
         f"measured step, the rest are timed; time / off (median), which the targets use, is the median over timed "
         f"rounds of the step's time over off's in the same round; time / off (min) is the fastest timed step over "
         f"off's fastest. Step = forward + backward with grads, no optimizer step (all variants read "
         f"the same weights). {result['data']}; torch {result['torch']}, {result['threads']} threads."),
        "",
        *_table(result),
        "",
        f"remat's Pareto frontier (measured peak vs time): {', '.join(f'`{n}`' for n in result['frontier'])}.",
        *(["", f"Budgets the gate refused: {', '.join(refused)}."] if refused else []),
        "",
        *_target_lines(result),
        "",
        ("Measured peak: bytes allocated above the step's start while forward and backward run (grads included), "
         "the same way for all variants "
         + ("(profiler allocation events)" if result["device"] == "cpu" else "(`torch.cuda.max_memory_allocated`)")
         + "; planned: remat's plan (total: what the gate holds against a budget, `remat.core.plan`; graph: the graph "
         "alone, no grads). "
         "`budget@f`: budget mode at a budget a fraction f of the way from the smallest named plan's total to "
         "off's; `budget@half`: halfway between layer's total and off's. `aot@x`: "
         "`torch.compile(backend=\"aot_eager\")` of remat's loss function (same loss chunks) with "
         "`activation_memory_budget` x (matching a budget point: the share of off's planned graph that budget "
         "mode's choice plans; 1.0 is AOT's default partition), autograd's backward. `torch_checkpoint`: the HF "
         "model, per-layer `torch.utils.checkpoint`, unchunked loss."),
    ]
    return "\n".join(lines) + "\n"


def _label_offsets(points: list[dict]) -> list[int]:
    """Vertical label offsets, in points: a label near earlier ones (close in memory and time) goes below them."""
    xs, ys = [v["measured_peak"] for v in points], [v["time_ratio"] for v in points]
    dx, dy = 0.03 * (max(xs) - min(xs) or 1), 0.03 * (max(ys) - min(ys) or 1)
    offsets = []
    for i in range(len(points)):
        near = sum(abs(xs[i] - xs[j]) < dx and abs(ys[i] - ys[j]) < dy for j in range(i))
        offsets.append(4 - 9 * near)
    return offsets


def plot(result: dict, dest: Path) -> bool:
    """Measured peak vs time ratio to off, every point labelled; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"remat": ("tab:blue", "o", "remat policy"), "remat_budget": ("tab:green", "s", "remat budget mode"),
             "torch_checkpoint": ("tab:orange", "^", "torch per-layer checkpoint"),
             "aot": ("tab:red", "D", "AOTAutograd activation_memory_budget")}
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=120)
    for kind, (color, marker, label) in style.items():
        pts = [v for v in result["variants"] if v["kind"] == kind]
        if pts:
            ax.scatter([v["measured_peak"] / MiB for v in pts], [v["time_ratio"] for v in pts], s=55, color=color,
                       marker=marker, zorder=3, label=label)
    for v, dy in zip(result["variants"], _label_offsets(result["variants"])):
        ax.annotate(v["variant"], (v["measured_peak"] / MiB, v["time_ratio"]), textcoords="offset points",
                    xytext=(5, dy), fontsize=7, color=style[v["kind"]][0])
    by = {v["variant"]: v for v in result["variants"]}
    front = [by[n] for n in result["frontier"]]
    ax.step([v["measured_peak"] / MiB for v in front], [v["time_ratio"] for v in front], where="post",
            color="tab:blue", alpha=0.4, linestyle="--", label="remat frontier")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("measured peak, MiB (forward + backward, grads included)")
    ax.set_ylabel("step time / off (median over rounds)")
    ax.set_title(f"remat bench --sweep: {title(result)}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(dest, format="png")
    plt.close(fig)
    return True


def write_outputs(result: dict, out: Path) -> list[str]:
    return bench.write_outputs(result, out, markdown, plot)


