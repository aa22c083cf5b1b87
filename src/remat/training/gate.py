"""The gate: whether a training job may run, and how. Admission in one place.

`admit(settings, budget)` plans the job and answers with the policy that fits and its plan (`Admitted`), or
refuses with figures (`GateRefused`, exit 3 / HTTP 422). The command line (`remat plan`), the trainer (on
every torchrun rank: `remat finetune`) and the server (`POST /train`, `/train/plan`) each ask it from one place.

It plans from the model's config, on fake weights (`Planners`: nothing of the model's size is allocated, a LoRA
whose own state cannot fit refused before PEFT allocates it), or from a planner of the real model (the trainer,
once its weights are loaded: the step that will run, traced). The budget is one value (`Budget`): the job's own,
at most the server's, else this machine's free memory shared by the ranks on it, less what the process took
since it was read (measured).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import transformers
from torch import nn

from remat.base.settings import GateRefused, TrainSettings, UsageError
from remat.core import devices, precision
from remat.core.capture import EagerStridesFakeMode
from remat.core.plan import Plan, mib
from remat.core.process import available_memory
from remat.models import adapters, planned
from remat.models import load as models
from remat.models.hf import causal_lm, loss_chunk_for
from remat.training.distributed import Ranks
from remat.training.step import Choice, Planner, StepShape, in_backward, may_run_in_backward, not_in_backward


@dataclass(frozen=True)
class Budget:
    """The bytes a job may allocate (its plan's total less the measured `runtime` and `trace`) and where that
    figure comes from. A budget read from free memory is lessened by what the process takes after the reading
    (`less`); one that was asked for (`--memory-budget`) is what the job may allocate, whatever the process holds.

    A device's job has two: `bytes` of the device's memory (`device`: where its step runs, `total` of its plan)
    and `host`, the host memory beside it (its plan's `host`: the process, the offloaded checkpoints).
    """

    bytes: int
    source: str  # "--memory-budget", "the server's budget", "free memory", ...
    read: bool = False  # from free memory: later growth of the process comes out of it
    deducted: tuple[tuple[str, int], ...] = ()
    device: str = "cpu"  # the memory `bytes` is of: the host's, or a device's ("cuda:0")
    host: Budget | None = None  # a device's job: the host's budget beside it

    @classmethod
    def of(cls, asked: int | None = None, *, cap: Budget | None = None, ranks_here: int = 1,
           device: torch.device | str = "cpu") -> Budget:
        """The job's own budget (`asked`, bytes), at most `cap` (a server's budget for its jobs); without one, `cap`;
        without either, the free memory now, shared by the `ranks_here` processes of a data-parallel run here. On
        a device, that is the device's memory (each rank has its own), with the host's free memory beside it."""
        if not devices.is_host(device):
            return cls._of_device(asked, cap, ranks_here, devices.planned(str(device)))
        if cap is not None:
            return cap if asked is None or cap.bytes <= asked else cls(asked, "the job's memory_budget")
        if asked is not None:
            return cls(asked, "--memory-budget")
        share = f", shared by {ranks_here} processes" if ranks_here > 1 else ""
        return cls(available_memory() // ranks_here, f"free memory{share}", read=True)

    @classmethod
    def _of_device(cls, asked: int | None, cap: Budget | None, ranks_here: int, device: torch.device) -> Budget:
        here = devices.present(device)  # else planned for a machine this is not: its host memory is not known here
        host = cap.host if cap is not None and cap.host is not None else \
            cls.of(ranks_here=ranks_here) if here else cls.unlimited()
        if cap is not None and (asked is None or cap.bytes <= asked):
            return cap
        if asked is not None:
            return cls(asked, "the job's memory_budget" if cap else "--memory-budget", device=str(device), host=host)
        if not here:
            raise UsageError(f"--device {device}: not on this machine, so its free memory is not known: give "
                             "--memory-budget (the card's memory)")
        free = cls(available_memory(device), f"free memory of {device}", True, device=str(device), host=host)
        # cuBLAS takes its workspace from the allocator at the first product, outside the step's plan
        return free.less("cuBLAS's workspace", devices.CUBLAS_WORKSPACE, on_device=True)

    @classmethod
    def unlimited(cls) -> Budget:
        """No limit: plans only (`remat plan` without a budget)."""
        return cls(1 << 62, "no limit")

    def less(self, what: str, nbytes: int, *, on_device: bool = False) -> Budget:
        """Read from free memory: less `nbytes` the process took since (`what`, measured), from the host's memory;
        `on_device`: from the device's (a server's KV caches where it decodes). Asked for: itself."""
        if self.host is not None and not on_device:
            return dataclasses.replace(self, host=self.host.less(what, nbytes))
        if not self.read or nbytes <= 0:
            return self
        return dataclasses.replace(self, bytes=self.bytes - nbytes, deducted=(*self.deducted, (what, nbytes)))

    def __str__(self) -> str:
        less = "".join(f", less {what} {mib(n)}" for what, n in self.deducted)
        if self.host is None:
            return f"{mib(self.bytes)} ({self.source}{less})"
        host = "no limit" if self.host.source == "no limit" else str(self.host)
        return f"{mib(self.bytes)} of {self.device} ({self.source}{less}); host {host}"


@dataclass
class Admitted:
    """The gate's answer for a job: the rank's settings and step shape, the budget, the chosen policy with the
    plans it looked at, and the planner that made them (its model: the planning model, or the real one)."""

    settings: TrainSettings  # one rank's: its share of the global batch
    shape: StepShape
    budget: Budget
    choice: Choice
    planner: Planner
    world_size: int = 1
    early: Admitted | None = field(default=None, repr=False)  # the trainer's: the answer from the config

    @property
    def policy(self) -> str:
        return self.choice.policy

    @property
    def plan(self) -> Plan:
        return self.choice.plan

    @property
    def plans(self) -> dict[str, Plan]:
        return self.choice.plans

    def answer(self) -> dict:
        """The answer as callers show it: the policy, why, the budget (bytes and source), every plan, and where the
        optimizer runs."""
        device = {"device": self.budget.device, "host_budget": self.budget.host.bytes} if self.budget.host else {}
        return {"policy": self.policy, "recompute_reason": self.choice.reason, "budget": self.budget.bytes,
                "budget_source": str(self.budget), "plans": {k: p.as_dict() for k, p in self.plans.items()},
                "optimizer": self.updates_note(), "dtype": self.shape.dtype,
                "dtype_reason": precision.resolve(self.settings.dtype, self.settings.device).reason, **device}

    def updates_note(self) -> str:
        """Where the optimizer runs, in one line (and why not in the backward, where it cannot be)."""
        if self.shape.updates:
            return "optimizer: in the backward (each parameter's update as its gradient is complete: no set of grads)"
        why = not_in_backward(self.settings, self.world_size)
        return "optimizer: after the backward" + (f" ({why})" if why else "")


def admit(s: TrainSettings, budget: Budget, *, world_size: int = 1, planner: Planner | None = None,
          planners: Planners | None = None) -> Admitted:
    """Plan the job `s` (its global batch split over `world_size` data-parallel ranks) and choose the fastest
    policy whose plan fits `budget` (`Planner.choose`), or raise GateRefused with the plans and the smallest.

    The step is planned by `planner` (the trainer's, of the real model), else by one of `planners` (a server's
    cache of planning models, by LoRA shape), else by a planning model made here from the model's config. Whether
    the window is within the model's maximum context is the caller's to say (a plan notes it, training refuses).
    """
    if planner is None:
        planners = planners or Planners(models.load_config(s.model))
        s = settled(s, planners.config, world_size)
        planner = planners.planner(s, budget)
    else:
        s = settled(s, causal_lm(planner.model).config, world_size)
    if s.optimizer_in_backward == "auto":
        # after the backward where the job fits so: the updates between the backward's ops cost time (SmolLM2 full
        # fine-tuning at ctx 512, one process, 8 interleaved pairs: 5.94 s a step against 5.57); in it where only
        # so it fits
        try:
            return _admitted(s.model_copy(update={"optimizer_in_backward": "off"}), budget, planner, world_size)
        except GateRefused:
            s = s.model_copy(update={"optimizer_in_backward": "on"})
    return _admitted(s, budget, planner, world_size)


def _admitted(s: TrainSettings, budget: Budget, planner: Planner, world_size: int) -> Admitted:
    local = Ranks(world_size=world_size, local_world_size=world_size).local(s)
    shape = StepShape.of(local)
    choice = planner.choose(shape, s.recompute, budget.bytes, world_size,
                            host=budget.host.bytes if budget.host is not None else None)
    return Admitted(local, shape, budget, choice, planner, world_size)


def settled(s: TrainSettings, config: transformers.PretrainedConfig, world_size: int = 1) -> TrainSettings:
    """`s` with what it leaves open chosen: the loss chunk from the model's shape (`hf.loss_chunk_for`), and
    where the optimizer runs: `on` or `off`, or `auto` where it may run in the backward (`may_run_in_backward`:
    `admit` settles it by the budget)."""
    chunk = s.loss_chunk if s.loss_chunk is not None else loss_chunk_for(config, walk=s.path == "walk")
    optimizer = "auto" if may_run_in_backward(s, world_size) else "on" if in_backward(s, world_size) else "off"
    return s.model_copy(update={"loss_chunk": chunk, "optimizer_in_backward": optimizer})


def lora_settings(s: TrainSettings) -> adapters.LoraSettings | None:
    """The adapter the settings ask for; None for full fine-tuning."""
    return adapters.LoraSettings(s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_targets) if s.lora else None


def with_lora(model: nn.Module, s: TrainSettings, budget: Budget) -> nn.Module:
    """The model with the LoRA `s` asks for (itself, for full fine-tuning), refused first when it cannot fit
    (`refuse_lora`, from the model's own linear shapes)."""
    lora = lora_settings(s)
    if lora is None:
        return model
    refuse_lora(s, budget, adapters.linear_shapes(model))
    return adapters.apply_lora(model, lora, seed=s.seed)


def refuse_lora(s: TrainSettings, budget: Budget, linears: list[tuple[str, int, int]]) -> None:
    """GateRefused when the adapter's weights, grads and optimizer states alone exceed the budget, reckoned from
    the base's linear layers (name, in, out) before PEFT allocates anything."""
    lora = lora_settings(s)
    if lora is None:
        return
    need = adapters.state_bytes(linears, lora)
    why = adapters.over_budget(need, budget.bytes, lora, "--lora-r")
    if why is not None:
        raise GateRefused(f"refused: {why}", extra={"lora_bytes": need})


class Planners:
    """Planners of one model's config on fake weights (shapes and dtypes, no weights), one per LoRA shape: the
    server keeps one for the model it serves (the plans of every shape a client asked for stay in them); a
    command makes one for its job. The base's linear layer shapes, for the LoRA's own gate, are read once."""

    def __init__(self, config: transformers.PretrainedConfig):
        self.config = config
        self._planners: dict[tuple[tuple | None, torch.device], Planner] = {}
        self._linears: list[tuple[str, int, int]] | None = None

    def planner(self, s: TrainSettings, budget: Budget) -> Planner:
        """The planner of the model `s` trains (its LoRA attached), the LoRA gated against `budget` first."""
        lora = lora_settings(s)
        key = None if lora is None else (lora.r, lora.alpha, lora.dropout, tuple(lora.targets or ()), s.weights)
        device = devices.planned(s.device)  # a device's step is traced for it: its kernels, its memory
        base = None if (key, device) in self._planners else self.base()
        refuse_lora(s, budget, self.linears(base))
        if base is not None:
            # quant: the frozen weights as the loaded model will hold them (a GGUF's blocks; --weights' mix)
            model = planned.plan_as_stored(base, s.model, s.weights, lora is not None)
            model = model if lora is None else adapters.apply_lora(model, lora, seed=s.seed)
            self._planners[key, device] = Planner(model, device)
        return self._planners[key, device]

    def linears(self, base: nn.Module | None = None) -> list[tuple[str, int, int]]:
        """The base's linear layers (`adapters.linear_shapes`), read once (of `base`, a new planning model of it,
        where given)."""
        if self._linears is None:
            self._linears = adapters.linear_shapes(base if base is not None else self.base())
        return self._linears

    def base(self) -> nn.Module:
        """A new planning model of the base: fake weights, as training would hold it."""
        with EagerStridesFakeMode(allow_non_fake_inputs=True):
            return models.build_from_config(self.config, seed=0)

    def forget_graphs(self, but: tuple[StepShape, ...] = ()) -> None:
        """Each planner's `forget_graphs`: plans kept, graphs dropped (but those of the shapes `but`)."""
        for planner in self._planners.values():
            planner.forget_graphs(but)
