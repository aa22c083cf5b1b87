"""`remat`: the command line. Parses arguments, calls the library, prints results.

Exit codes: 0 ok, 1 a check failed (verify), 2 bad input, 3 refused by the memory gate.
With --json, stdout holds one JSON object and nothing else; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError

from remat.base import collector
from remat.base.settings import (
    Cli,
    MiB,
    Note,
    RematError,
    Renamed,
    ServeSettings,
    TrainSettings,
    UsageError,
    describe,
)

# Nothing heavy at import time (torch, transformers): `remat --help` and argument errors answer at once.
# Every option comes from a field of remat.base.settings: its type, bounds, default and help are declared there.

EXIT_CHECK_FAILED = 1
M = TypeVar("M", bound=BaseModel)


def _field_type(cls: type[BaseModel], name: str) -> Callable[[str], object]:
    """An argparse `type` that validates one field with pydantic, so a bad value is a usage error."""
    info = cls.model_fields[name]
    annotation: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    adapter = TypeAdapter(annotation)

    def parse(text: str):
        try:
            return adapter.validate_python(text)
        except ValidationError as e:
            raise argparse.ArgumentTypeError(describe(e, flags=True).lstrip(": ")) from None

    return parse


def add_fields(p: argparse.ArgumentParser, cls: type[BaseModel], names: str, **defaults: object) -> None:
    """Options for the fields `names` (space-separated) of a settings class; `defaults` override its defaults."""
    for name in names.split():
        info = cls.model_fields[name]
        cli = next((m for m in info.metadata if isinstance(m, Cli)), Cli())
        flags = cli.flags or ("--" + name.replace("_", "-"),)
        default = defaults.get(name, info.default)
        shown = "" if default is None or default == [] or isinstance(default, bool) else f" (default {default})"
        kwargs: dict[str, Any] = {"dest": name, "help": (info.description or "").replace("%", "%%") + shown}
        if cli.action in ("store_true", "store_false"):
            p.add_argument(*flags, action=cli.action, default=default, **kwargs)
        else:
            choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else ()
            metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
            if cli.action in ("append", "store"):  # append: each value is one item; checked with the settings
                p.add_argument(*flags, default=default, metavar=metavar, action=cli.action, **kwargs)
            else:
                p.add_argument(*flags, type=_field_type(cls, name), default=default, metavar=metavar, **kwargs)


def settings_from(cls: type[M], args: argparse.Namespace, **extra: object) -> M:
    """The settings object for the parsed options (cross-field rules are checked here)."""
    values = {k: v for k, v in vars(args).items() if k in cls.model_fields} | extra
    try:
        return cls(**values)
    except ValidationError as e:
        raise UsageError(describe(e, flags=True)) from None


MODEL_OPTIONS = "model ctx batch loss_chunk path ubatch walk"
LORA_OPTIONS = "lora lora_r lora_alpha lora_dropout lora_targets"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1 (got {text!r})")
    return int(text)


def _ctx_or_max(text: str) -> int | str:
    """`remat plan --ctx`: a window, or max (the longest within the budget)."""
    if text == "max":
        return text
    try:
        return _field_type(TrainSettings, "ctx")(text)  # type: ignore[return-value]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}, or max") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remat", description="Fine-tune language models in less memory.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    as_json: dict[str, Any] = {"action": "store_true", "help": "print one JSON object on stdout"}

    f = sub.add_parser("finetune", help="train a model; prints a receipt")
    add_fields(f, TrainSettings, " ".join(n for n in TrainSettings.model_fields if n != "weights"))  # plan only
    f.add_argument("--json", **as_json)

    pl = sub.add_parser("plan", help="memory plan from the config alone; allocates nothing")
    add_fields(pl, TrainSettings, f"{MODEL_OPTIONS.replace(' ctx ', ' ')} {LORA_OPTIONS} memory_budget weights device "
               "dtype optimizer_in_backward")
    pl.add_argument("--ctx", type=_ctx_or_max, default=512, metavar="CTX",
                    help="tokens per window (default 512), or max: the longest window that fits the budget, on the "
                    "window path and on the walk (in multiples of --ubatch)")
    pl.add_argument("--recompute", default="both", metavar="POLICY",
                    help="both (off and on, the default), a policy (off, on, dots, offload, every:K), or budget / "
                    "auto: the fastest plan within --memory-budget")
    pl.add_argument("--world-size", type=_positive, default=1, metavar="N",
                    help="processes of a data-parallel run (torchrun): one rank's figures, --batch being the "
                    "global batch (default 1)")
    pl.add_argument("--json", **as_json)

    v = sub.add_parser("verify", help="one step comparing every recompute clone with its original")
    add_fields(v, TrainSettings, "model ctx batch loss_chunk", ctx=128)
    v.add_argument("--explain", action="store_true", help="print what is kept across the backward, and why")
    v.add_argument("--json", **as_json)

    e = sub.add_parser("export", help="write the base model with a trained adapter merged in (HF layout)")
    e.add_argument("--merge", action="store_true", required=True, help="merge the adapter into the base weights")
    e.add_argument("--adapter", required=True, help="adapter folder written by `remat finetune --out`")
    e.add_argument("--out", required=True, help="new folder for the merged model")
    e.add_argument("--model", help="the base (default: the one recorded in the adapter)")

    add_fields(sub.add_parser("serve", help="serve completions and train in the background"),
               ServeSettings, " ".join(ServeSettings.model_fields))

    b = sub.add_parser("bench", help="memory and time side by side: recompute off/on, torch checkpointing, eager")
    add_fields(b, TrainSettings, f"{MODEL_OPTIONS} lr out", ctx=512, lr=1e-4, out="remat-bench")
    b.add_argument("--steps", type=_field_type(TrainSettings, "steps"), default=3,
                   help="training steps per variant, the first a warm-up (default 3, at least 2)")
    b.add_argument("--lora", action="store_true",
                   help="every variant trains the same LoRA adapter (r 8) from the same init "
                   "(default: full fine-tuning)")
    b.add_argument("--json", action="store_true", help="print the bench.json object on stdout")
    b.add_argument("--sweep", action="store_true",
                   help="a Pareto sweep instead: every recompute policy, budget mode at several budgets, torch "
                   "checkpointing and AOTAutograd's activation_memory_budget (--steps rounds, the first a warm-up)")
    return p


def fail(code: int, message: str) -> int:
    # One write with its newline: ranks of a torchrun job share stderr, and print's two writes interleave.
    sys.stderr.write(f"remat: error: {message}\n")
    sys.stderr.flush()
    return code


def _show_warning(message, category, *args, **kwargs) -> None:
    if issubclass(category, Renamed):  # an old spelling: the user should hear of the new one
        print(f"remat: warning: {message}", file=sys.stderr)
    elif issubclass(category, Note):
        print(f"remat: note: {message}", file=sys.stderr)


def run() -> None:
    """The process's entry (`remat`, `python -m remat`). A plan exits without the interpreter's teardown: freeing
    its traced graphs' fake tensors one by one takes a second or more, and a plan leaves nothing to clean up.
    So does a rank of a data-parallel run: torch's distributed objects destroyed at exit can abort it."""
    argv = sys.argv[1:]
    code = main(argv)
    distributed = sys.modules.get("remat.training.distributed")  # imported where a run can have ranks
    if argv[:1] == ["plan"] or (distributed is not None and distributed.joined_a_group()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning  # library deprecation chatter is not for users; renames are
    args = parser().parse_args(argv)
    commands = {"finetune": cmd_finetune, "plan": cmd_plan, "verify": cmd_verify, "export": cmd_export,
                "serve": cmd_serve, "bench": cmd_bench}
    try:
        return commands[args.command](args)
    except RematError as e:  # bad input 2, refused by the gate 3: the error type says which
        return fail(e.exit_code, str(e))
    except KeyboardInterrupt:
        return fail(130, "interrupted")
    except Exception as e:  # no traceback as the answer; REMAT_DEBUG=1 shows it
        if os.environ.get("REMAT_DEBUG"):
            raise
        return fail(1, f"{type(e).__name__}: {e} (set REMAT_DEBUG=1 for the traceback)")


def emit(args: argparse.Namespace, result: dict, human: str) -> None:
    print(json.dumps(result) if args.json else human)


def table(plans: dict, ran: str | None = None) -> str:
    """Plans side by side, in MiB; `ran` marks the one that ran."""
    cats = ["params", "frozen", "grads", "optimizer", "graph", "step", "cache", "workspace", "trace", "runtime",
            "total"]
    cols = list(plans)
    device = next((p["device"] for p in plans.values() if "device" in p), None)  # a device's plans: two memories
    if device is not None:
        cats += ["offload", "host"]
    heads = [f"recompute {c}" + (" *" if c == ran else "") for c in cols]
    width = max(16, *(len(h) + 2 for h in heads))  # a saved-back policy's name is longer ("on+21 *")
    lines = [f"{'MiB':<10}" + "".join(f"{h:>{width}}" for h in heads)]
    for cat in cats:
        lines.append(f"{cat:<10}" + "".join(f"{plans[c][cat] / MiB:>{width},.1f}" for c in cols))
    if device is None:
        lines.append("total: params + frozen + optimizer + trace + runtime + the larger of step (graph and grads) + "
                     "cache and grads + workspace (the optimizer's update)")
    else:
        lines.append(f"total: {device}'s memory: params + frozen + optimizer + the larger of step (graph and grads) "
                     "+ cache and grads + workspace; host: runtime + trace + offload (checkpoints in pinned memory)")
    if {"on", "off"} <= set(plans):
        lines.append(f"graph on/off: {plans['on']['graph'] / plans['off']['graph']:.3f}, "
                     f"total on/off: {plans['on']['total'] / plans['off']['total']:.3f}")
    return "\n".join(lines)


def cmd_finetune(args: argparse.Namespace) -> int:
    from remat.core.process import keep_for_good
    from remat.training import distributed
    from remat.training.train import Hooks, finetune

    def show_plan(gate: dict, heading: str = "") -> None:  # before the first step: what the run will hold at once
        print(f"{heading}budget: {gate['budget_source']}\nrecompute: {gate['policy']} ({gate['recompute_reason']})\n"
              f"{table(gate['plans'], ran=gate['policy'])}\n{gate['optimizer']}", file=sys.stderr, flush=True)

    def show_early_plan(gate: dict) -> None:
        show_plan(gate, "planned from the model's config, before its weights load (traced, the step's own memory "
                        "is added as `trace`):\n")

    hooks = Hooks(on_plan=show_plan, on_early_plan=show_early_plan)
    keep_for_good()  # the imports: the run's heap trims need not walk them
    receipt = finetune(settings_from(TrainSettings, args), progress=True, hooks=hooks)
    if not distributed.is_main():  # a data-parallel run: rank 0 alone prints the receipt
        return 0
    r = receipt.as_dict()
    losses = " ".join(f"{x:.6f}" for x in r["losses"])
    human = "\n".join([
        f"model: {r['model']}  trainable parameters: {r['trainable_parameters']:,}  "
        + f"frozen: {r['frozen_parameters']:,}",
        f"steps: {r['steps']}  losses: {losses}",
        f"recompute: {r['policy']} ({r['recompute_reason']})",
        f"compute: {r['dtype']} ({r['dtype_reason']})",
        *([f"path: walk, {r['settings']['walk']} walk in chunks of {r['settings']['ubatch']}"]
          if r["settings"]["path"] == "walk" else []),
        *([f"processes: {r['world_size']} (plans per rank; optimizer state per rank, MiB: "
           + " ".join(f"{b / MiB:,.2f}" for b in r["optimizer_state_bytes"]) + ")"] if r["world_size"] > 1 else []),
        table(r["plans"], ran=r["policy"]),
        f"measured: graph peak {r['measured']['graph'] / MiB:,.1f} MiB (planned {r['plan']['graph'] / MiB:,.1f}), "
        f"process peak RSS {r['process_peak']['rss'] / MiB:,.1f} MiB (planned total {r['plan']['total'] / MiB:,.1f})",
        f"seconds per epoch: {r['seconds_per_epoch']:.2f}  tokens/s: {r['tokens_per_second']:.0f}",
        f"chunks: {r['chunks']}  window p50 {r['window_p50']:.3f} s  p95 {r['window_p95']:.3f} s",
        *([f"chunk windows (s): {' '.join(f'{x:.3f}' for x in r['chunk_seconds'])}"] if r["chunks"] > r["steps"]
          else []),
        *(["saved: " + ", ".join(r["outputs"])] if r["outputs"] else []),
    ])
    emit(args, r, human)
    return 0


# A plan makes ~10^5 fake objects a window, in a process that ends: collecting them (walking the imports and the
# graphs kept) took 3.1 s of an 18 s `--ctx max`, to free ~30 MiB.
@collector.paused
def cmd_plan(args: argparse.Namespace) -> int:
    from remat.core import devices, precision
    from remat.models import load as models
    from remat.training import gate, step

    which = args.recompute
    if args.ctx == "max":
        return _plan_longest(args)
    s = settings_from(TrainSettings, args, recompute="auto" if which == "both" else which)
    config = models.load_config(s.model)
    if s.ctx > models.max_ctx(config):  # a plan answers "would it fit"; training there is refused
        print(f"remat: note: --ctx {s.ctx} is above the model's maximum context {models.max_ctx(config)}",
              file=sys.stderr)
    gated = which in ("budget", "auto")  # else only the plans asked for: no budget to hold them to
    device = devices.planned(s.device)  # a device this machine lacks is planned all the same
    budget = gate.Budget.of(s.memory_budget, ranks_here=args.world_size, device=device) if gated else \
        gate.Budget.unlimited()
    admitted = gate.admit(s, budget, world_size=args.world_size, planners=gate.Planners(config))
    shown = list(admitted.plans) if gated else ["off", "on"] if which == "both" else [step.policy_name(which)]
    result: dict[str, Any] = {"model": s.model or "default", "ctx": s.ctx, "batch": s.batch, "path": s.path,
                              "walk": s.walk if s.path == "walk" else None, "loss_chunk": admitted.settings.loss_chunk,
                              "lora": s.lora, "device": str(device), "world_size": args.world_size,
                              "rank_batch": admitted.settings.batch, "weights": s.weights,
                              "optimizer_in_backward": admitted.settings.optimizer_in_backward,
                              "dtype": admitted.shape.dtype,
                              "dtype_reason": precision.resolve(s.dtype, s.device).reason,
                              "plans": {k: admitted.plans[k].as_dict() for k in shown}}
    if gated:
        result |= {"policy": admitted.policy, "reason": admitted.choice.reason, "plan": admitted.plan.as_dict(),
                   "budget": admitted.budget.bytes, "budget_source": str(admitted.budget)}
    human = (table(result["plans"]) + "\n" + admitted.updates_note()
             + f"\ncompute: {result['dtype']} ({result['dtype_reason']})")
    if args.world_size > 1:
        human = (f"per rank of {args.world_size} processes (batch {admitted.settings.batch} of {s.batch}; "
                 "optimizer state sharded as ZeRO does it):\n") + human
    if gated:
        human += f"\nbudget: {admitted.budget}\nchosen: {result['policy']} ({result['reason']})"
    emit(args, result, human)
    return 0


def _plan_longest(args: argparse.Namespace) -> int:
    """`remat plan --ctx max`: the longest window within the budget on each path, with the gate's plan there. The
    paths are searched side by side (`forked.side_by_side`): the walk in a child process where there is a core."""
    from remat.core import devices
    from remat.core.forked import side_by_side
    from remat.models import load as models
    from remat.training import gate
    from remat.training.longest import PATHS, longest, summary

    recompute = "auto" if args.recompute == "both" else args.recompute
    s = settings_from(TrainSettings, args, ctx=args.ubatch, recompute=recompute)  # each probe sets its own ctx
    config = models.load_config(s.model)
    budget = gate.Budget.of(s.memory_budget, ranks_here=args.world_size, device=devices.planned(s.device))

    def answer(path: str) -> tuple[dict, str, list[str]]:
        """The path's answer, its line, and the gate's plans at the window found (picklable: a child's)."""
        a = longest(s, budget, gate.Planners(config), args.world_size, paths=(path,))[0]
        if a.admitted is None:
            return a.as_dict(), a.line(), []
        return a.as_dict(), a.line(), [
            f"\n{a.path} at {a.ctx:,} tokens: recompute {a.admitted.policy} ({a.admitted.choice.reason})",
            table({k: p.as_dict() for k, p in a.admitted.plans.items()}, ran=a.admitted.policy),
            a.admitted.updates_note()]

    answers = side_by_side([functools.partial(answer, path) for path in PATHS])
    result = summary(s, budget, [d for d, _, _ in answers], models.max_ctx(config), args.world_size)
    human = [f"longest window within the budget {budget}:", *(f"  {line}" for _, line, _ in answers)]
    human += [text for _, _, block in answers for text in block]
    emit(args, result, "\n".join(human))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from remat.bench import compare as bench

    if args.sweep:
        from remat.bench import sweep

        return sweep.main(args)
    return bench.main(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from remat.serve import app as serve_app

    return serve_app.main(settings_from(ServeSettings, args))


def cmd_export(args: argparse.Namespace) -> int:
    from remat.models.adapters import merge_into_base

    files = merge_into_base(args.model, args.adapter, args.out)
    print("\n".join(files))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from remat.core import policies
    from remat.core.graph import StepInputs
    from remat.core.recompute import COMPARED, explain, verify
    from remat.models import load as models
    from remat.training.step import Planner, StepShape

    s = settings_from(TrainSettings, args)
    loaded = models.load_model(s.model, as_stored=False)  # every weight trains, as in full fine-tuning
    models.check_ctx(s.ctx, loaded.model.config)
    shape, planner = StepShape.of(s), Planner(loaded.model)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, loaded.model.config.vocab_size, (2, s.batch, s.ctx), generator=g)
    result = verify(planner.build(shape, True), StepInputs.of(loaded.model).args(ids, labels))
    d = result.first_difference
    out = {"clones": result.clones, "equal": result.equal, "first_difference": d and vars(d), "compared": COMPARED}
    if d is None:
        human = f"all {result.clones} clones equal ({COMPARED})"
    else:
        where = f" output {d.output}" if d.output is not None else ""
        human = (f"{result.clones} clones compared ({COMPARED}); first difference: {d.node} ({d.op}){where} in "
                 f"{d.mark}, shape {d.shape}, max abs diff {d.max_abs_diff:g}")
    if args.explain:  # per policy: what each keeps across the backward, and why
        base = planner.build(shape, "off")
        explained = {name: explain(base, p) for name in ("on", "dots", "every:2") if (p := policies.parse(name))}
        out["explain"] = {name: {"kept": e.kept, "counts": {k: dict(v) for k, v in e.counts.items()},
                                 "recomputed": dict(e.recomputed)} for name, e in explained.items()}
        human = "\n".join(f"policy {name}:\n{e.format()}" for name, e in explained.items()) + "\n" + human
    emit(args, out, human)
    return 0 if result.equal else EXIT_CHECK_FAILED
