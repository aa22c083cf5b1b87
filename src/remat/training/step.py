"""The step, built in one place: trace (and rewrite) the train step for a model and settings, once.

The trainer, `remat plan`, `remat verify`, the bench and the server's `/train` all get
their graph and its plans here, so a setting changes the graph the same way everywhere.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.base import collector
from remat.base.settings import GateRefused, TrainSettings
from remat.core import policies
from remat.core.capture import EagerStridesFakeMode, capture
from remat.core.graph import TrainGraph
from remat.core.plan import Plan, mib, plan, world_size
from remat.core.recompute import Rewriter, keep_reasons, saved_nodes
from remat.fastplan import pieces, stamp
from remat.models import adapters, planned, stored
from remat.models import load as models
from remat.training import walk


@dataclass(frozen=True)
class StepShape:
    """What fixes the traced graph: the path, the batch and window (or chunk) shape, and the loss pieces."""

    path: str  # "window" or "walk"
    batch: int
    ctx: int
    ubatch: int | None  # walk: tokens per chunk
    loss_chunk: int
    walk: str | None = None  # walk: "exact" or "truncated"

    @classmethod
    def of(cls, s: TrainSettings) -> StepShape:
        on_walk = s.path == "walk"
        return cls(s.path, s.batch, s.ctx, s.ubatch if on_walk else None, s.loss_chunk, s.walk if on_walk else None)


@collector.paused
def build(model: nn.Module, shape: StepShape, policy: str | bool) -> TrainGraph:
    """The traced (and, unless the policy is "off", rewritten) step for this model and shape, traced once.

    `policy` names a recompute policy (`remat.core.policies`: off, on/layer, dots, every:K, or one that
    `choose` made and cached); True means "on", False "off". The cache lives on the model: an epoch,
    every chunk of a walk, and the plans of every policy reuse one trace.
    """
    return _build(_Step.of(model, shape), policy)


@dataclass(frozen=True)
class _Step:
    """A model's step of one shape, and what is cached for it on the model (`cache`): keyed by the shape and
    the names of the parameters it trains, worked out once per call (a walk over every module)."""

    model: nn.Module
    shape: StepShape
    key: tuple

    @classmethod
    def of(cls, model: nn.Module, shape: StepShape) -> _Step:
        return cls(model, shape, (shape, tuple(n for n, p in model.named_parameters() if p.requires_grad)))

    def cache(self, kind: str) -> dict:
        return self.model.__dict__.setdefault(kind, {}).setdefault(self.key, {})


def _build(at: _Step, policy: str | bool) -> TrainGraph:
    name = policy_name(policy)
    graphs = at.cache("_remat_graphs")
    if name not in graphs:
        chosen = at.cache("_remat_saved_back").get(name) or _policy(at, name)
        graphs[name] = _traced_step(at) if chosen is None else _rewriter(at)(chosen)
    return graphs[name]


def _policy(at: _Step, name: str) -> policies.Policy | None:
    """The policy named; for off, None (the trace as it is), but where the model holds stored weights
    (`remat.models.stored`) the trace rewritten to recompute their float copies alone (quant)."""
    return policies.parse(name) or (policies.everything() if any(stored.stored(at.model)) else None)


def _traced_step(at: _Step) -> TrainGraph:
    """The step as traced, before any rewrite."""
    graphs = at.cache("_remat_graphs")
    if "traced" not in graphs:
        graphs["traced"] = _trace(at)
    return graphs["traced"]


def _rewriter(at: _Step) -> Rewriter:
    """The rewriter of the traced step: every policy's rewrite, and each probe of a budget search, shares it."""
    made = at.cache("_remat_rewriters")
    if "rewriter" not in made:
        made["rewriter"] = Rewriter(_traced_step(at))
    return made["rewriter"]


def forget_graphs(model: nn.Module) -> None:
    """Drop the traced steps cached on `model` and keep their plans: a shape asked again is answered from them,
    and one whose graph is needed again (a budget search, a policy not planned yet) is traced again. A server
    plans each new shape a client asks for; kept, each one's graphs held 25 MiB and 150,000 objects (SmolLM2
    with LoRA), which every full collection then walks: 0.4 s after five shapes, 0.7 s after twelve."""
    for kind in ("_remat_graphs", "_remat_rewriters", "_remat_stamps"):
        model.__dict__.pop(kind, None)


def policy_name(policy: str | bool) -> str:
    """The canonical name: "on" for the per-layer policy (also spelled "layer" or True), "off" for False."""
    if isinstance(policy, bool):
        return "on" if policy else "off"
    return "on" if policy == "layer" else policy


def _trace(at: _Step) -> TrainGraph:
    model, shape = at.model, at.shape
    if shape.path == "walk":
        assert shape.ubatch is not None
        return walk.capture_chunk(model, shape.batch, shape.ctx, shape.ubatch, loss_chunk=shape.loss_chunk,
                                  exact=shape.walk != "truncated")
    stamper = _stamper(at)
    return stamper.graph() if stamper is not None else _traced(model, shape)


def _traced(model: nn.Module, shape: StepShape) -> TrainGraph:
    """The step traced whole; on fake weights (only planned, never run) with its loss's pieces stamped."""
    ids = torch.zeros(shape.batch, shape.ctx, dtype=torch.long)

    def whole() -> TrainGraph:
        return capture(model, ids, ids.clone(), loss_chunk=shape.loss_chunk)  # two tensors: two inputs

    if _planning(model):
        with contextlib.suppress(stamp.NotStampable):
            return pieces.stamp(whole, shape.ctx, shape.loss_chunk)
    return whole()


def _stamper(at: _Step) -> stamp.Stamper | None:
    """The step of a planning model (fake weights) stamped from a few of its layers' trace (`remat.fastplan.stamp`),
    made once per shape; None where it is traced whole (a walk; a model whose layers do not stamp)."""
    made = at.cache("_remat_stamps")
    if "stamper" not in made:
        made["stamper"] = None
        if at.shape.path != "walk" and _planning(at.model):
            with contextlib.suppress(stamp.NotStampable):
                made["stamper"] = stamp.stamp(at.model, lambda: _traced(at.model, at.shape))
    return made["stamper"]


def _planning(model: nn.Module) -> bool:
    return any(isinstance(p, FakeTensor) for p in model.parameters())


@collector.paused
def plans(model: nn.Module, shape: StepShape, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """The memory plan of the step under each policy named (off, on, layer, dots, every:K)."""
    at = _Step.of(model, shape)
    return {k: _plan(at, k) for k in which}


def _plan(at: _Step, policy: str) -> Plan:
    """`plan(build(model, shape, policy))`, made once per rank count (the optimizer's share); a rewrite not made
    yet is planned without making it. A copy: the trainer fills in what it measures."""
    name = policy_name(policy)
    made = at.cache("_remat_plans")
    key = name, world_size()
    if key not in made:
        made[key] = _planned(at, name)
    return dataclasses.replace(made[key])


def _planned(at: _Step, name: str) -> Plan:
    if name in at.cache("_remat_graphs"):  # a graph already made
        return plan(_build(at, name))
    chosen = _policy(at, name)
    stamper = _stamper(at) if name in LAYERS_ALIKE else None
    if stamper is not None:  # planned from the few layers traced, rewritten: no graph of the whole step
        with contextlib.suppress(stamp.NotStampable):
            return stamper.plan(chosen)
    # off; else a rewrite planned without making it
    return plan(_build(at, name)) if chosen is None else _rewriter(at).plan(chosen)


# The policies that save alike in every layer: a stamped step's plans under them are stamped too (`_planned`).
LAYERS_ALIKE = ("off", "dots", "on")

# From most memory (fastest) to least; each saves a subset of what the one before it saves. every:K recomputes
# the marks between its kept ones as second-level checkpoints, and each layer from the mark below (Chen et al.),
# so it plans below "on" up to K near sqrt(layers): graph, tiny-llama, 16 layers, batch 1, ctx 256: 2.3 MB on,
# 1.8 every:2, 1.7 every:4 (2.0 every:8); SmolLM2 ctx 2048 full fine-tuning: 305 MiB on, 238 every:2, 212 every:4.
LADDER = ("off", "dots", "on", "every:2", "every:4")


@dataclass
class Choice:
    """The gate's answer: the policy that runs, why, and the plans it looked at."""

    policy: str
    reason: str
    plans: dict[str, Plan]

    @property
    def plan(self) -> Plan:
        return self.plans[self.policy]


@collector.paused
def choose(model: nn.Module, shape: StepShape, recompute: str, budget: int) -> Choice:
    """The gate: the fastest plan that fits `budget` among those `recompute` allows, or GateRefused.

    A named policy is taken as it is. "auto" tries no recompute first; "budget" starts with the
    built-ins from the fastest down (`LADDER`, without off), takes the first that fits, then saves back
    what the next faster one saves (for dots: off, everything), the values most expensive to recompute
    per byte first (FLOPs, `policies.recompute_cost`), while the plan still fits.
    """
    at = _Step.of(model, shape)
    choice = _choose(at, recompute, budget)
    for name in ("off", "on"):  # shown beside the choice: what recompute saves (or costs) on this job
        choice.plans.setdefault(name, _plan(at, name))
    return choice


def _choose(at: _Step, recompute: str, budget: int) -> Choice:
    if recompute not in ("auto", "budget"):
        name = policy_name(recompute)
        named = {name: _plan(at, name)}
        if named[name].total <= budget:
            return Choice(name, f"plan {mib(named[name].total)} fits the budget {mib(budget)}", named)
        _refuse(at, budget, named)
    ladder = LADDER if recompute == "auto" else LADDER[1:]
    found: dict[str, Plan] = {}
    for name in ladder:
        found[name] = _plan(at, name)
        if found[name].total <= budget:
            break
    else:
        _refuse(at, budget, found)
    if name == "off":
        return Choice(name, f"recompute not needed: plan {mib(found[name].total)} fits the budget {mib(budget)}",
                      found)
    over = [k for k in ladder if k != name and k in found]  # the faster built-ins: none fits
    faster = LADDER[LADDER.index(name) - 1]  # the next faster one: over the budget, or off (budget mode: untried)
    refined = _save_back(at, budget, faster, name, found[name])
    if refined is not None:
        name, found[name] = refined
    if not over:
        return Choice(name, f"{name} plans {mib(found[name].total)}, within the budget {mib(budget)}", found)
    figures = ", ".join(f"{k} plans {mib(found[k].total)}" for k in over)
    return Choice(name, f"{figures}: over the budget {mib(budget)}; {name} plans {mib(found[name].total)}", found)


def _save_back(at: _Step, budget: int, faster: str, fitting: str, fitting_plan: Plan) -> tuple[str, Plan] | None:
    """Between two ladder rungs: save the fitting rung's set plus the values the faster one saves (off: every
    one the backward reads), the costliest to recompute per byte first, as many as fit."""
    rewriter = _rewriter(at)
    fit = policies.parse(fitting)
    fast = policies.parse(faster) or policies.everything()
    assert fit is not None
    kept = keep_reasons(rewriter.tg, fit)
    extra = [n for n in saved_nodes(rewriter.tg) if n not in kept and fast.saves(n)
             and not policies.always_recomputed(n)]  # quant: no float copy of a stored weight is saved back
    extra.sort(key=lambda n: -policies.recompute_cost(n) / max(1, _nbytes(n)))

    def saving(k: int) -> tuple[policies.Policy, dict]:
        names = frozenset(n.name for n in extra[:k])
        chosen = policies.Policy(f"{fitting}+{k}", lambda n: fit.saves(n) or n.name in names)
        return chosen, kept | dict.fromkeys(extra[:k], chosen.name)  # what keep_reasons would keep

    probed: dict[int, Plan] = {}

    def probe(k: int) -> int:  # planned without making the graph: most of a rewrite's time is making it
        probed[k] = rewriter.plan(*saving(k))
        return probed[k].total

    k = _most_that_fit(list(itertools.accumulate(map(_nbytes, extra), initial=0)), probe, budget, fitting_plan.total)
    if k == 0:
        return None
    chosen = saving(k)[0]
    at.cache("_remat_saved_back")[chosen.name] = chosen  # `build` makes its graph if it runs
    return chosen.name, probed[k]


def _most_that_fit(saved: list[int], probe: Callable[[int], int], budget: int, start: int) -> int:
    """The largest k whose plan `probe(k)` fits the budget, plans growing with k; `start`, plan 0, fits.

    `saved[k]` is the bytes the first k values hold. A plan grows by about the same share of each byte saved
    back (the values live from the forward into their backward), so a probe goes where a line through the
    plans known meets the budget (`_guess`). Safeguards keep the worst case near a bisection's: until a plan
    is over the budget, each fitting probe doubles the least step to the next; a guess that leaves over half
    its bracket is followed by a bisection. A probe is a rewrite: mostly 3 to 5, not log2(len(saved)).
    """
    lo, hi = 0, len(saved)  # plan lo fits; hi is past the end, or a k whose plan does not fit
    totals = {0: start}
    stride, width = 1, hi
    while hi - lo > 1:
        k = _guess(saved, totals, lo, hi, budget)
        if hi == len(saved):
            k = min(max(k, lo + stride), hi - 1)
        elif hi - lo > width // 2:
            k = (lo + hi) // 2
        width = hi - lo
        totals[k] = probe(k)
        if totals[k] <= budget:
            lo, stride = k, 2 * stride
        else:
            hi = k
    return lo


def _guess(saved: list[int], totals: dict[int, int], lo: int, hi: int, budget: int) -> int:
    """Where the line through two known plans (the bracket's ends; before a probe went over, plan 0 and the
    largest that fits) meets the budget, kept inside the bracket."""
    a, b = (lo, hi) if hi in totals else (0, lo)
    slope = (totals[b] - totals[a]) / (saved[b] - saved[a]) if saved[b] > saved[a] else 1.0
    reach = saved[lo] + (budget - totals[lo]) / max(slope, 1e-9)
    return min(max(bisect.bisect_right(saved, reach) - 1, lo + 1), hi - 1)


def _nbytes(n) -> int:
    val = n.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _refuse(at: _Step, budget: int, found: dict[str, Plan]) -> None:
    for name in LADDER:
        found.setdefault(name, _plan(at, name))
    smallest = min(found, key=lambda k: found[k].total)
    figures = ", ".join(f"recompute {k}: {mib(p.total)} (graph {mib(p.graph)})" for k, p in found.items())
    fixed = found[smallest].total - found[smallest].graph - found[smallest].cache
    raise GateRefused(
        f"refused: the job needs more than the memory budget {mib(budget)} ({figures}); the smallest plan "
        f"remat can make is {smallest} at {mib(found[smallest].total)}, of which parameters, grads and "
        f"optimizer take {mib(fixed)}: lower --ctx or --batch, use --recompute {smallest}, or raise --memory-budget",
        {k: p.as_dict() for k, p in found.items()})


def lora_settings(s: TrainSettings) -> adapters.LoraSettings | None:
    """The adapter the settings ask for; None for full fine-tuning."""
    return adapters.LoraSettings(s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_targets) if s.lora else None


def planning_model(config, s: TrainSettings, budget: int | None = None) -> nn.Module:
    """The model as training would hold it, built on fake tensors: shapes and dtypes, no weights. With a
    `budget`, an adapter whose own state cannot fit it is refused first (`refuse_lora_over`)."""
    model: nn.Module
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = models.build_from_config(config, seed=s.seed)
    model = planned.plan_as_stored(model, s.model, s.weights, s.lora)  # quant: frozen weights as loaded
    lora = lora_settings(s)
    if lora is not None:  # outside the fake mode: PEFT cannot swap fake weights, and the adapter is small
        if budget is not None:
            refuse_lora_over(model, lora, budget)
        model = adapters.apply_lora(model, lora, seed=s.seed)
    return model


def refuse_lora_over(model: nn.Module, lora: adapters.LoraSettings, budget: int) -> None:
    """GateRefused when the adapter's weights, grads and optimizer states alone exceed the budget: reckoned
    from the base's shapes, before PEFT allocates them."""
    why = adapters.over_budget(adapters.state_bytes(adapters.linear_shapes(model), lora), budget, lora, "--lora-r")
    if why is not None:
        raise GateRefused(f"refused: {why}")


def plan_settings(s: TrainSettings, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """Plans from the model's config alone: nothing of the model's size is allocated."""
    return plans(planning_model(models.load_config(s.model), s), StepShape.of(s), which)
