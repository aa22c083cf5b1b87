"""The trainer: data -> windows -> one traced step per batch shape -> AdamW -> receipt.

`finetune` is `_setup` (named steps: files, the gate from the config, the model and data, the gate on the
traced step, the optimizer) then `_train`, the loop on one screen: for each optimizer step run the (rewritten)
graph over its batches, hand the grads to AdamW, record the loss.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from remat.base.files import staged
from remat.base.settings import RematError, TrainSettings, UsageError, percentile
from remat.core import devices, precision
from remat.core.graph import StepInputs, TrainGraph
from remat.core.plan import Measured, measure
from remat.core.process import (
    give_back_kept,
    process_peak,
    resident,
    resident_bytes,
    reuse_freed_memory,
    trim_heap,
)
from remat.models import adapters
from remat.models import load as models
from remat.models.hf import UnsupportedModel
from remat.models.hf_cache import Probes
from remat.training import checkpoints, data, distributed, gate, in_backward, walk
from remat.training.step import Planner, StepShape


@dataclass
class Hooks:
    """Calls a caller (the CLI, the server) gets: the gate's answer, before each chunk (it may wait, or raise
    Cancelled), after each step."""

    before_chunk: Callable[[], None] = lambda: None
    on_step: Callable[[dict], None] = lambda event: None
    on_plan: Callable[[dict], None] = lambda gate: None  # the gate's answer, before the first step (main rank)
    # The gate's answer from the model's config, before its weights load (main rank): plans in seconds, without
    # the trace's own memory. None: not asked (it costs a planning trace; the server gates its jobs itself).
    on_early_plan: Callable[[dict], None] | None = None


class BatchRunner:
    """Runs one batch of windows through the step graph: as one chunk (window path) or ctx/ubatch chunks (walk)."""

    def __init__(self, model: torch.nn.Module, graph: TrainGraph, s: TrainSettings, hooks: Hooks,
                 probes: Probes | None = None):
        self.graph, self.hooks = graph, hooks
        self.tensors = StepInputs.of(model)
        self.device = next(model.parameters()).device  # the batches go where the step runs
        self.walk = walk.Walk(model, s.batch, s.ctx, s.ubatch, s.walk == "exact", probes,
                              StepShape.of(s).compute) if s.path == "walk" else None
        self.measured: Measured | None = None
        self.chunk_seconds: list[float] = []

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        if self.walk is None:
            return self._chunk([input_ids, labels])
        loss, grads = 0.0, list[torch.Tensor]()
        for inputs in self.walk.chunks(input_ids, labels, self.hooks.before_chunk):
            chunk_loss, grads = self._chunk(inputs)  # each chunk adds into the window's sums and returns them
            loss += chunk_loss
        return loss, grads

    def _chunk(self, inputs: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        self.hooks.before_chunk()
        t0 = time.perf_counter()
        args = self.tensors.args(*inputs)
        if self.measured is None:  # the first chunk runs observed: the receipt's measured peak
            (loss, *grads), self.measured = measure(self.graph, args)
        else:
            loss, grads = self.graph(*args)
        self.chunk_seconds.append(time.perf_counter() - t0)
        return loss.item(), grads


@dataclass
class Receipt:
    """What a run did, in figures: the one place its keys are named (`as_dict` is the JSON the CLI prints)."""

    model: str
    losses: list[float]
    device: str  # where the step ran: cpu, or the device and its name ("cuda:0 (NVIDIA H100 80GB HBM3)")
    recompute: bool
    policy: str  # what is saved for the backward: off, on, dots, every:K, or a budget's choice
    recompute_reason: str
    plan: dict[str, int]  # the plan that ran
    plans: dict[str, dict[str, int]]  # the plans the gate needed
    measured: dict[str, int] | None  # the graph's peak, observed on the first chunk
    process_peak: dict[str, int]  # the whole process at the end: peak RSS (and CUDA's allocator peaks)
    trainable_parameters: int
    frozen_parameters: int
    seconds_per_epoch: float
    tokens_per_second: float
    chunk_seconds: list[float]
    settings: dict
    resumed_from: str | None = None
    checkpoints: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    world_size: int = 1  # processes of a data-parallel run; then `plan` and `plans` are one rank's
    optimizer_state_bytes: list[int] = field(default_factory=list)  # per rank, its optimizer's real state tensors
    dtype: str = "float32"  # what the step computed in (`--dtype`, auto resolved)
    dtype_reason: str = ""  # why: asked for, or what auto found

    @property
    def steps(self) -> int:
        return len(self.losses)

    def as_dict(self) -> dict:
        chunks = self.chunk_seconds
        return {**asdict(self), "steps": self.steps, "chunks": len(chunks),
                "window_p50": percentile(chunks, 0.5) if chunks else None,
                "window_p95": percentile(chunks, 0.95) if chunks else None}


def finetune(s: TrainSettings, *, progress: bool = True, hooks: Hooks | None = None) -> Receipt:
    """Train as `s` says and return the receipt; under torchrun, on every rank (see `remat.training.distributed`)."""
    distributed.from_env().local(s)  # a batch that does not split ends every rank before any joins (no race)
    with distributed.group(s.dist_timeout) as ranks:
        try:  # the run is _train's alone: freed when it returns, before what it freed is given back
            return _train(_setup(s, ranks, hooks or Hooks()), progress=progress and ranks.is_main)
        finally:
            give_back_kept()  # the job's freed tensors: a server lives on after it


@dataclass
class _Run:
    """What the setup made for the loop."""

    s: TrainSettings
    dp: distributed.Ranks
    hooks: Hooks
    out: Path | None
    resume: checkpoints.Checkpoint | None
    loaded: models.LoadedModel
    model: torch.nn.Module  # the loaded model, with its LoRA
    windows: data.Windows
    admitted: gate.Admitted
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    runner: BatchRunner


def _train(run: _Run, *, progress: bool) -> Receipt:
    """The loop: each optimizer step runs its batches' graphs, hands their grads to AdamW, records the loss."""
    s, dp = run.s, run.dp
    per_epoch, total = s.optimizer_steps(len(run.windows))
    trainable = StepInputs.of(run.model).trainable
    losses: list[float] = checkpoints.restore(run.resume, trainable, run.optimizer, rank=dp.rank,
                                              world_size=dp.world_size) if run.resume else []
    first = len(losses)
    bar = tqdm(total=total, initial=first, desc="finetune", unit="step", file=sys.stderr, disable=not progress)
    start = time.perf_counter()
    batches, epoch_of_batches, saved = [], -1, []
    for n in range(first, total):
        epoch, i = divmod(n, per_epoch)
        if epoch != epoch_of_batches:
            batches, epoch_of_batches = data.batches(run.windows, s.batch, seed=s.seed, epoch=epoch), epoch
        # No local may hold the grads past the optimizer: zero_grad(set_to_none) must free them before the
        # next step's graph runs (a held set cost one params-sized copy of process memory).
        step_loss = set_grads(run.params, run.runner, batches[i * s.accumulate:(i + 1) * s.accumulate], dp)
        if not run.admitted.shape.updates:  # else every parameter was updated inside the step
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        tokens = (len(losses) - first) * s.accumulate * s.batch * s.ctx
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
        bar.update()
        run.hooks.on_step({"epoch": epoch, "step": len(losses), "loss": step_loss, "steps": total})
        if s.save_every and run.out and len(losses) % s.save_every == 0:
            saved.append(str(dp.save_checkpoint(run.out, len(losses), trainable, run.optimizer, losses,
                                                {"loss_chunk": s.loss_chunk})))
    bar.close()
    return _receipt(run, losses, first, saved, time.perf_counter() - start)


def _setup(s: TrainSettings, dp: distributed.Ranks, hooks: Hooks) -> _Run:
    """Everything before the first step, in order: the gate from the config (before the weights load), the
    model and data, the gate again on the traced step, the optimizer. Each step refuses what it can first."""
    if s.weights is not None:
        raise UsageError("--weights sizes a plan (`remat plan`); training holds the weights the model stores")
    device = devices.resolve(s.device)  # a device this machine lacks: refused before anything is read or written
    s = s.model_copy(update={"device": str(device)})  # every plan and the receipt name the device the step runs on
    devices.prepare(device)
    reuse_freed_memory()  # the process peak then follows what is live, as the plan counts it
    runtime = resident()  # the process before the model: the plans' `runtime`; free memory excludes it
    # before the model takes its share
    budget = gate.Budget.of(s.memory_budget, ranks_here=dp.local_world_size, device=device)
    out, resume, records = _setup_files(s)
    s = _settled(s, resume, dp.world_size)
    if hooks.on_early_plan is not None:
        _setup_early_gate(s, dp, budget, runtime, hooks.on_early_plan)
        planned_at = resident()  # what planning left in the process (the modules it imported, caches) stays
        budget, runtime = budget.less("what planning left", planned_at - runtime), planned_at
    torch.manual_seed(s.seed)
    # a preset's weights are fixed: the seed is the run's, not the base's. A LoRA's base stays as stored (quant),
    # on the CPU: the stored kernels are the CPU's, so a device's model is float (dequantized as it loads)
    loaded = models.load_model(s.model, as_stored=s.lora and devices.is_host(device))
    torch.nn.Module.to(loaded.model, device)  # the model, so its steps: traced for the device its weights are on
    models.check_ctx(s.ctx, loaded.model.config)
    windows = data.load_windows(records, loaded.tokenizer, s.ctx, s.batch, pack=s.pack)
    s.optimizer_steps(len(windows))  # data too short for --accumulate: refused before tracing
    model = gate.with_lora(loaded.model, s, budget)
    dp.seed(s.seed)
    # What loading left beside the weights (the tokenizer, the GGUF reader's residue) is the process's too: the
    # weights' resident pages are taken off, not their size (a file's weights mapped lazily, as safetensors are, are
    # resident only as far as loading read them: the plans' `frozen` counts them whole)
    runtime = max(runtime, resident() - resident_bytes(t for t in (*model.parameters(), *model.buffers())
                                                       if t.device.type == "cpu"))
    admitted = _setup_gate(s, dp, model, budget, runtime, hooks)
    params = list(StepInputs.of(model).trainable.values())
    optimizer = dp.optimizer(params, lr=s.learning_rate, weight_decay=0.0)
    planner = admitted.planner
    graph = planner.build(admitted.shape, admitted.policy)
    if admitted.shape.updates:  # each parameter's update inside the step, as its gradient is complete
        in_backward.ready_state(optimizer)
        graph = in_backward.updating(graph, in_backward.Update(optimizer, params))
    runner = BatchRunner(model, graph, admitted.settings, hooks, planner.probes)
    return _Run(s, dp, hooks, out, resume, loaded, model, windows, admitted, params, optimizer, runner)


def _settled(s: TrainSettings, resume: checkpoints.Checkpoint | None, world_size: int) -> TrainSettings:
    """What the settings leave open (the loss chunk, the optimizer's place: `gate.settled`), chosen once, before
    anything is planned: a resumed run keeps the loss chunk its checkpoint chose, so it computes the losses it
    began with; else the model's shape says."""
    kept = checkpoints.chosen(resume).get("loss_chunk") if resume and s.loss_chunk is None else None
    if kept is not None:
        s = s.model_copy(update={"loss_chunk": kept})
    return gate.settled(s, models.load_config(s.model), world_size)


def _setup_files(s: TrainSettings) -> tuple[Path | None, checkpoints.Checkpoint | None, data.Records]:
    """The output folder (empty, unless resuming), the checkpoint to resume from, the data's records: refused
    before anything is loaded."""
    out = Path(s.out) if s.out else None
    if out and out.exists() and (not out.is_dir() or any(out.iterdir())) and not s.resume:
        raise UsageError(f"--out {out} exists and is not an empty folder")
    resume = checkpoints.latest(s.resume) if s.resume else None
    records = data.Records.of(s.data if s.data is not None else data.default_data_path())
    return out, resume, records


def _setup_early_gate(s: TrainSettings, dp: distributed.Ranks, budget: gate.Budget, runtime: int,
                      show: Callable[[dict], None]) -> None:
    """The gate on the model's config (fake weights), before its weights load: a job that cannot fit is refused
    before anything of its size is allocated, and the plans show in seconds. Every rank asks (each would refuse
    alike); the gate answers again once the real step is traced."""
    config = models.load_config(s.model)
    models.check_ctx(s.ctx, config)
    try:
        early = gate.admit(s, budget, world_size=dp.world_size, planners=gate.Planners(config))
    except (RematError, UnsupportedModel):  # the traced gate would say the same, after loading the weights
        raise
    except Exception:  # noqa: BLE001 - a family whose code does not run on fake weights: the traced gate answers
        return
    for p in early.plans.values():
        p.runtime = runtime
    if dp.is_main:
        show(early.answer())
    del early
    trim_heap()  # what the planning held goes back to the kernel: the trace's share is measured from here


def _setup_gate(s: TrainSettings, dp: distributed.Ranks, model: torch.nn.Module, budget: gate.Budget,
                runtime: int, hooks: Hooks) -> gate.Admitted:
    """The gate on the step that will run, traced: its graphs (off and on, the two every answer shows) are made
    first, so the memory they take (`trace`) is counted; then the chosen one alone is kept, its code made, and the
    trace measured again."""
    planner = Planner(model)
    shape = StepShape.of(dp.local(s))
    if shape.path == "walk":  # the walk's probes run the model on two tokens: its weights are paged in here (the
        planner.probes.state_shapes(shape.batch, shape.ctx)  # plan's params), not counted again as the trace
    trim_heap()  # the trace is measured on a trimmed heap at both ends
    before = resident()
    for name in ("off", "on"):
        planner.build(shape, name)
    admitted = gate.admit(s, budget.less("the trace", resident() - before), world_size=dp.world_size,
                          planner=planner)
    planner.keep_only(shape, admitted.policy).make_code()
    trim_heap()  # compiling the code takes ~10x the memory the code keeps (the demo: ~75 MiB, 8 kept)
    trace = max(0, resident() - before)
    for p in admitted.plans.values():  # the budget covers what the job allocates; the total, the whole process
        p.runtime, p.trace = runtime, trace
    if dp.is_main:
        hooks.on_plan(admitted.answer())
    devices.preflight(planner.build(shape, admitted.policy), next(model.parameters()).device)
    return admitted


def _receipt(run: _Run, losses: list[float], first: int, saved: list[str], elapsed: float) -> Receipt:
    s, dp, admitted, tensors = run.s, run.dp, run.admitted, StepInputs.of(run.model)
    trained = len(losses) - first
    per_epoch = s.optimizer_steps(len(run.windows))[0]
    return Receipt(
        model=run.loaded.name, losses=losses, device=devices.name(torch.device(s.device)),
        recompute=admitted.policy != "off", policy=admitted.policy,
        recompute_reason=admitted.choice.reason, plan=admitted.plan.as_dict(),
        plans={k: p.as_dict() for k, p in admitted.plans.items()},
        measured=run.runner.measured.as_dict() if run.runner.measured else None,
        process_peak=process_peak(),
        trainable_parameters=sum(p.numel() for p in run.params),
        frozen_parameters=sum(t.numel() for t in tensors.frozen.values()),
        seconds_per_epoch=elapsed / max(trained, 1) * per_epoch,
        tokens_per_second=trained * s.accumulate * s.batch * s.ctx / elapsed,
        chunk_seconds=run.runner.chunk_seconds,
        settings={**s.model_dump(), "lr": s.learning_rate, "memory_budget": admitted.budget.bytes,
                  "optimizer_in_backward": admitted.settings.optimizer_in_backward,  # `auto` as the gate settled it
                  "data": s.data if isinstance(s.data, str) or s.data is None else "<records>"},
        resumed_from=str(run.resume.path) if run.resume else None,
        checkpoints=saved,
        outputs=save_outputs(run.model, run.loaded, s, run.out) if run.out and dp.is_main else [],
        world_size=dp.world_size,
        optimizer_state_bytes=dp.optimizer_state_bytes(run.optimizer),
        dtype=admitted.shape.dtype, dtype_reason=precision.resolve(s.dtype, s.device).reason,
    )


def set_grads(params: list[torch.Tensor], runner: BatchRunner, batches: list,
              dp: distributed.Ranks = distributed.ONE) -> float:
    """Run the batches of one optimizer step, set each parameter's .grad to their mean; -> the mean loss.

    Data-parallel, each rank runs its windows of each batch, weighted by its share of the batch's targets;
    the sum over ranks is the 1-process mean."""
    step_loss, grads = 0.0, list[torch.Tensor]()
    for batch in batches:
        part = dp.part(*batch)
        loss, g = part.weigh(*runner.run(part.input_ids, part.labels))
        step_loss += loss / len(batches)
        grads = [a.add_(b) for a, b in zip(grads, g)] if grads else g
    step_loss = dp.all_reduce(step_loss, grads)
    for p, total in zip(params, grads):
        p.grad = total.div_(len(batches)) if len(batches) > 1 else total
    return step_loss


def save_outputs(model: torch.nn.Module, loaded: models.LoadedModel, s: TrainSettings, out: Path) -> list[str]:
    """The trained adapter (PEFT + GGUF) or full model (HF layout) into `out`, each file moved in whole."""
    with staged(out, mode="merge") as staging:
        if s.lora:
            gguf = models.default_gguf_path() if s.model is None else (
                Path(s.model) if str(s.model).endswith(".gguf") else None)
            adapters.save_adapter(model, staging,  # type: ignore[arg-type]  # a PeftModel when s.lora
                                  base_name=s.model or adapters.DEFAULT_BASE, base_gguf=gguf)
        else:
            loaded.model.save_pretrained(staging, safe_serialization=True)
            loaded.tokenizer.save_pretrained(staging)
        files = sorted(str(out / f.name) for f in staging.iterdir())
    return files
