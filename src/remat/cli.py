"""`remat`: the command line. Parses arguments, calls the library, prints results.

Exit codes: 0 ok, 1 a check failed (verify), 2 bad input, 3 refused by the memory gate.
With --json, stdout holds one JSON object and nothing else; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

# Nothing heavy at import time: `remat --help` and argument errors answer at once.
DEFAULT_LOSS_CHUNK = 256  # remat.capture.DEFAULT_LOSS_CHUNK; a test keeps the two equal

EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_REFUSED = 1, 2, 3


def integer(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {'positive' if minimum == 1 else f'at least {minimum}'}, "
                                             f"got {value}")
        return value

    return parse


positive_int, non_negative_int = integer(1), integer(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def memory_size(text: str) -> int:
    from remat.plan import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def lora_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--full", action="store_true", help="full fine-tuning instead of a LoRA adapter")
    c.add_argument("--lora-r", type=positive_int, default=8)
    c.add_argument("--lora-alpha", type=positive_float, default=16.0)
    c.add_argument("--lora-dropout", type=float, default=0.0)
    c.add_argument("--lora-targets", help="comma-separated module names (default: every linear layer)")


def lora_settings(args: argparse.Namespace):
    from remat.adapters import LoraSettings

    if args.full:
        return None
    targets = args.lora_targets.split(",") if args.lora_targets else None
    return LoraSettings(args.lora_r, args.lora_alpha, args.lora_dropout, targets)


def serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file, HF safetensors folder, or preset (default: embedded SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=integer(0), default=8080, help="port (default 8080)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require this key (Authorization: Bearer KEY or X-Api-Key); repeatable")
    p.add_argument("--parallel", "-np", type=integer(1), default=1,
                   help="requests that decode at once; more wait (default 1)")
    p.add_argument("--ctx", type=integer(1), help="context size for serving (default: the model's maximum)")
    p.add_argument("--max-slowdown-ppm", type=integer(0), default=50_000,
                   help="how much training may slow decoding, in parts per million (default 50000 = 5%%)")
    p.add_argument("--memory-budget", type=memory_size, help="memory for training jobs, e.g. 2GiB (default: free memory)")
    p.add_argument("--state-dir", default="remat-state",
                   help="folder for jobs, their events and adapters (default ./remat-state)")
    p.add_argument("--max-body", type=integer(1), default=64 << 20,
                   help="largest request body in bytes (default 64 MiB)")
    p.add_argument("--threads", type=integer(1), help="torch CPU threads (default: torch's choice)")


def bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file, HF safetensors folder, or preset (default: embedded SmolLM2-135M)")
    p.add_argument("--ctx", type=positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch", type=positive_int, default=1, help="windows per step (default 1)")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="training steps per variant, the first a warm-up (default 3, at least 2)")
    p.add_argument("--path", choices=("ubatch", "walk"), default="ubatch",
                   help="remat's path: ubatch (one graph per window) or walk (chunks of --ubatch over a KV cache)")
    p.add_argument("--ubatch", type=positive_int, default=256, help="walk: tokens per chunk (default 256)")
    p.add_argument("--loss-chunk", type=non_negative_int, default=DEFAULT_LOSS_CHUNK,
                   help=f"remat's loss in pieces of this many tokens, 0 = one piece (default {DEFAULT_LOSS_CHUNK})")
    p.add_argument("--lr", type=positive_float, default=1e-4)
    p.add_argument("--out", default="remat-bench", help="folder for bench.json, bench.md, bench.png "
                   "(default remat-bench)")
    p.add_argument("--json", action="store_true", help="print the bench.json object on stdout")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remat", description="Fine-tune language models in less memory.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_args(c: argparse.ArgumentParser, ctx: int) -> None:
        c.add_argument("--model", help="GGUF file, HF safetensors folder, or preset (default: embedded SmolLM2-135M)")
        c.add_argument("--ctx", type=positive_int, default=ctx, help=f"tokens per window (default {ctx})")
        c.add_argument("--batch", type=positive_int, default=1, help="windows per step (default 1)")
        c.add_argument("--loss-chunk", type=non_negative_int, default=DEFAULT_LOSS_CHUNK,
                       help=f"tokens per piece of the loss head, 0 = one piece (default {DEFAULT_LOSS_CHUNK})")
        c.add_argument("--path", choices=("ubatch", "walk"), default="ubatch",
                       help="ubatch: one graph per window; walk: chunks of --ubatch tokens over a KV cache")
        c.add_argument("--ubatch", type=positive_int, default=256, help="walk: tokens per chunk (default 256)")
        c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    f = sub.add_parser("finetune", help="train a model; prints a receipt")
    model_args(f, 256)
    f.add_argument("--data", help="text file, JSONL {text} or JSONL chat {messages} (default: bundled corpus)")
    f.add_argument("--pack", action="store_true",
                   help="concatenate documents into windows (default: one document per window, padding masked)")
    f.add_argument("--epochs", type=positive_int, default=1)
    f.add_argument("--steps", type=positive_int, help="stop after this many optimizer steps")
    f.add_argument("--accumulate", type=positive_int, default=1, help="windows per optimizer step (default 1)")
    f.add_argument("--lr", type=positive_float, help="learning rate (default 1e-3 with LoRA, 1e-4 with --full)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--recompute", choices=("on", "off", "auto"), default="auto",
                   help="recompute per-layer intermediates in backward (default auto: only when needed to fit)")
    f.add_argument("--memory-budget", type=memory_size, help="e.g. 2GiB (default: free memory of the device)")
    f.add_argument("--out", help="folder for the adapter (PEFT + adapter.gguf), or the model with --full")
    lora_args(f)
    f.add_argument("--save-every", type=positive_int, help="write a checkpoint every N steps into --out")
    f.add_argument("--resume", help="continue from the latest checkpoint in this folder")

    pl = sub.add_parser("plan", help="memory plan from the config alone; allocates nothing")
    model_args(pl, 512)
    pl.add_argument("--recompute", choices=("on", "off", "both"), default="both")
    lora_args(pl)

    e = sub.add_parser("export", help="write the base model with a trained adapter merged in (HF layout)")
    e.add_argument("--merge", action="store_true", required=True, help="merge the adapter into the base weights")
    e.add_argument("--adapter", required=True, help="adapter folder written by `remat finetune --out`")
    e.add_argument("--out", required=True, help="new folder for the merged model")
    e.add_argument("--model", help="the base (default: the one recorded in the adapter)")
    serve_args(sub.add_parser("serve", help="serve completions and train in the background"))
    bench_args(sub.add_parser("bench", help="memory and time side by side: recompute off/on, torch checkpointing, eager"))

    v = sub.add_parser("verify", help="one step comparing every recompute clone with its original")
    model_args(v, 128)
    v.add_argument("--explain", action="store_true", help="print what is kept across the backward, and why")
    return p


def fail(code: int, message: str) -> int:
    print(f"remat: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation chatter, not for users
    from remat.adapters import AdapterError
    from remat.checkpoints import CheckpointError
    from remat.data import DataError
    from remat.models import ModelError
    from remat.plan import GateRefused
    from remat.train import UsageError

    try:
        commands = {"finetune": cmd_finetune, "plan": cmd_plan, "verify": cmd_verify, "export": cmd_export,
                    "serve": cmd_serve, "bench": cmd_bench}
        return commands[args.command](args)
    except GateRefused as e:
        return fail(EXIT_REFUSED, str(e))
    except (ModelError, DataError, UsageError, AdapterError, CheckpointError) as e:
        return fail(EXIT_BAD_INPUT, str(e))
    except KeyboardInterrupt:
        return fail(130, "interrupted")
    except Exception as e:  # no traceback as the answer; REMAT_DEBUG=1 shows it
        if os.environ.get("REMAT_DEBUG"):
            raise
        return fail(1, f"{type(e).__name__}: {e} (set REMAT_DEBUG=1 for the traceback)")


def emit(args: argparse.Namespace, result: dict, human: str) -> None:
    print(json.dumps(result) if args.json else human)


def table(plans: dict) -> str:
    from remat.plan import MiB

    cats = ["params", "frozen", "grads", "optimizer", "graph", "cache", "total"]
    cols = list(plans)
    lines = [f"{'MiB':<10}" + "".join(f"{'recompute ' + c:>16}" for c in cols)]
    for cat in cats:
        lines.append(f"{cat:<10}" + "".join(f"{plans[c][cat] / MiB:>16,.1f}" for c in cols))
    if {"on", "off"} <= set(plans):
        lines.append(f"graph on/off: {plans['on']['graph'] / plans['off']['graph']:.3f}, "
                     f"total on/off: {plans['on']['total'] / plans['off']['total']:.3f}")
    return "\n".join(lines)


def cmd_finetune(args: argparse.Namespace) -> int:
    from remat.train import Settings, finetune

    lora_targets = args.lora_targets.split(",") if args.lora_targets else None
    settings = Settings(model=args.model, data=args.data, ctx=args.ctx, batch=args.batch, epochs=args.epochs,
                        steps=args.steps, lr=args.lr, seed=args.seed, recompute=args.recompute,
                        loss_chunk=args.loss_chunk, path=args.path, ubatch=args.ubatch,
                        accumulate=args.accumulate, pack=args.pack, memory_budget=args.memory_budget, out=args.out,
                        lora=not args.full, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                        lora_dropout=args.lora_dropout, lora_targets=lora_targets,
                        save_every=args.save_every, resume=args.resume)
    r = finetune(settings, progress=True)
    losses = " ".join(f"{x:.6f}" for x in r["losses"])
    human = "\n".join([
        f"model: {r['model']}  trainable parameters: {r['trainable_parameters']:,}  "
        + f"frozen: {r['frozen_parameters']:,}",
        f"steps: {r['steps']}  losses: {losses}",
        f"recompute: {'on' if r['recompute'] else 'off'} ({r['recompute_reason']})",
        table({"on" if r["recompute"] else "off": r["plan"]}),
        f"measured graph peak: {r['measured']['graph'] / 2**20:,.1f} MiB",
        f"seconds per epoch: {r['seconds_per_epoch']:.2f}  tokens/s: {r['tokens_per_second']:.0f}",
        f"chunks: {r['chunks']}  window p50 {r['window_p50']:.3f} s  p95 {r['window_p95']:.3f} s",
        *([f"chunk windows (s): {' '.join(f'{x:.3f}' for x in r['chunk_seconds'])}"] if r["chunks"] > r["steps"]
          else []),
        *(["saved: " + ", ".join(r["outputs"])] if r["outputs"] else []),
    ])
    emit(args, r, human)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from remat.models import load_config
    from remat.plan import plan_model

    if args.path == "walk" and args.ctx % args.ubatch:
        return fail(EXIT_BAD_INPUT, f"--ctx {args.ctx} must be a multiple of --ubatch {args.ubatch} on the walk path")
    limit = load_config(args.model).max_position_embeddings
    if args.ctx > limit:  # a plan answers "would it fit"; training there is refused
        print(f"remat: note: --ctx {args.ctx} is above the model's maximum context {limit}", file=sys.stderr)
    plans = plan_model(args.model, args.ctx, args.batch, loss_chunk=args.loss_chunk, path=args.path,
                       ubatch=args.ubatch, lora=lora_settings(args))
    keep = ["off", "on"] if args.recompute == "both" else [args.recompute]
    result = {"model": args.model or "default", "ctx": args.ctx, "batch": args.batch, "path": args.path,
              "loss_chunk": args.loss_chunk, "lora": not args.full,
              "plans": {k: plans[k].as_dict() for k in keep}}
    emit(args, result, table(result["plans"]))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from remat import bench

    return bench.main(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from remat.serve import app as serve_app

    return serve_app.main(args)


def cmd_export(args: argparse.Namespace) -> int:
    from remat.adapters import merge_into_base

    files = merge_into_base(args.model, args.adapter, args.out)
    print("\n".join(files))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from remat import models
    from remat.capture import StepInputs, capture
    from remat.recompute import explain, rewrite, verify

    loaded = models.load_model(args.model)
    if args.ctx > loaded.max_ctx:
        return fail(EXIT_BAD_INPUT, f"--ctx {args.ctx} is above the model's maximum context {loaded.max_ctx}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.model.config.vocab_size, (args.batch, args.ctx), generator=g)
    labels = torch.randint(0, loaded.model.config.vocab_size, (args.batch, args.ctx), generator=g)
    tg = capture(loaded.model, ids, labels, loss_chunk=args.loss_chunk)
    result = verify(rewrite(tg), StepInputs.of(loaded.model).args(ids, labels))
    d = result.first_difference
    out = {"clones": result.clones, "equal": result.equal, "first_difference": d and vars(d)}
    if result.equal:
        human = f"all {result.clones} clones equal"
    else:
        human = (f"{result.clones} clones compared; first difference: {d.node} ({d.op}) in {d.mark}, "
                 f"shape {d.shape}, max abs diff {d.max_abs_diff:g}")
    if args.explain:
        e = explain(tg)
        out["explain"] = {"kept": e.kept, "counts": {k: dict(v) for k, v in e.counts.items()},
                          "recomputed": dict(e.recomputed)}
        human = e.format() + "\n" + human
    emit(args, out, human)
    return 0 if result.equal else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
