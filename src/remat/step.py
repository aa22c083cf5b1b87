"""The step, built in one place: trace (and rewrite) the train step for a model and settings, once.

The trainer, `remat plan`, `remat verify`, the bench and the server's `/train` all get
their graph and its plans here, so a setting changes the graph the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from remat import adapters, models, policies, walk
from remat.capture import EagerStridesFakeMode, capture
from remat.graph import TrainGraph
from remat.plan import Plan, mib, plan
from remat.recompute import rewrite, saved_nodes
from remat.settings import GateRefused, TrainSettings


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


def build(model: nn.Module, shape: StepShape, policy: str | bool) -> TrainGraph:
    """The traced (and, unless the policy is "off", rewritten) step for this model and shape, traced once.

    `policy` names a recompute policy (`remat.policies`: off, on/layer, dots, every:K, or one that
    `choose` made and cached); True means "on", False "off". The cache lives on the model: an epoch,
    every chunk of a walk, and the plans of every policy reuse one trace.
    """
    name = policy_name(policy)
    cache = _cache(model, shape)
    if name not in cache:
        chosen = policies.parse(name)
        cache[name] = _trace(model, shape) if chosen is None else rewrite(build(model, shape, "off"), chosen)
    return cache[name]


def _cache(model: nn.Module, shape: StepShape) -> dict[str, TrainGraph]:
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    return model.__dict__.setdefault("_remat_graphs", {}).setdefault((shape, trainable), {})


def policy_name(policy: str | bool) -> str:
    """The canonical name: "on" for the per-layer policy (also spelled "layer" or True), "off" for False."""
    if isinstance(policy, bool):
        return "on" if policy else "off"
    return "on" if policy == "layer" else policy


def _trace(model: nn.Module, shape: StepShape) -> TrainGraph:
    if shape.path == "walk":
        assert shape.ubatch is not None
        return walk.capture_chunk(model, shape.batch, shape.ctx, shape.ubatch, loss_chunk=shape.loss_chunk,
                                  exact=shape.walk != "truncated")
    ids = torch.zeros(shape.batch, shape.ctx, dtype=torch.long)
    return capture(model, ids, ids.clone(), loss_chunk=shape.loss_chunk)  # two tensors: two inputs


def plans(model: nn.Module, shape: StepShape, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """The memory plan of the step under each policy named (off, on, layer, dots, every:K)."""
    return {k: plan(build(model, shape, k)) for k in which}


# From most memory (fastest) to least; each saves a subset of what the one before it saves. every:K is not
# on it: with memoised clones a segment's recompute keeps all K layers' intermediates alive, so it plans
# above "on" (tiny-llama, 16 layers, ctx 256: graph 2.3 MB on, 2.9 every:2, 4.8 every:4, 9.2 every:8).
LADDER = ("off", "dots", "on")


@dataclass
class Choice:
    """The gate's answer: the policy that runs, why, and the plans it looked at."""

    policy: str
    reason: str
    plans: dict[str, Plan]

    @property
    def plan(self) -> Plan:
        return self.plans[self.policy]


def choose(model: nn.Module, shape: StepShape, recompute: str, budget: int) -> Choice:
    """The gate: the fastest plan that fits `budget` among those `recompute` allows, or GateRefused.

    A named policy is taken as it is. "auto" tries no recompute first; "budget" starts with the
    built-ins from the fastest down, takes the first that fits, then saves back the values most
    expensive to recompute per byte (FLOPs, `policies.recompute_cost`) while the plan still fits.
    """
    choice = _choose(model, shape, recompute, budget)
    for name in ("off", "on"):  # shown beside the choice: what recompute saves (or costs) on this job
        choice.plans.setdefault(name, plan(build(model, shape, name)))
    return choice


def _choose(model: nn.Module, shape: StepShape, recompute: str, budget: int) -> Choice:
    if recompute not in ("auto", "budget"):
        name = policy_name(recompute)
        named = plans(model, shape, (name,))
        if named[name].total <= budget:
            return Choice(name, f"plan {mib(named[name].total)} fits the budget {mib(budget)}", named)
        _refuse(model, shape, budget, named)
    ladder = LADDER if recompute == "auto" else LADDER[1:]
    found: dict[str, Plan] = {}
    for name in ladder:
        found[name] = plan(build(model, shape, name))
        if found[name].total <= budget:
            break
    else:
        _refuse(model, shape, budget, found)
    i = ladder.index(name)
    if i == 0:
        return Choice(name, f"recompute not needed: plan {mib(found[name].total)} fits the budget {mib(budget)}",
                      found)
    slower = ladder[i - 1]  # the fastest built-in that does not fit
    over = ", ".join(f"{k} plans {mib(found[k].total)}" for k in ladder[:i])
    refined = _save_back(model, shape, budget, slower, name) if slower != "off" else None
    if refined is not None:
        name, found[name] = refined[0], refined[1]
    return Choice(name, f"{over}: over the budget {mib(budget)}; {name} plans {mib(found[name].total)}", found)


def _save_back(model: nn.Module, shape: StepShape, budget: int, faster: str,
               fitting: str) -> tuple[str, Plan] | None:
    """Between two ladder rungs: save the fitting rung's set plus the costliest-per-byte values of the faster
    one, as many as fit (a binary search over that order: plans grow with what is saved)."""
    base = build(model, shape, "off")
    fast, fit = policies.parse(faster), policies.parse(fitting)
    assert fast is not None and fit is not None
    extra = [n for n in saved_nodes(base) if fast.saves(n) and not fit.saves(n)]
    extra.sort(key=lambda n: -policies.recompute_cost(n) / max(1, _nbytes(n)))
    best: tuple[str, Plan] | None = None
    lo, hi = 1, len(extra)
    while lo <= hi:
        k = (lo + hi) // 2
        names = frozenset(n.name for n in extra[:k])

        def saves(n: fx.Node, names: frozenset[str] = names) -> bool:
            return fit.saves(n) or n.name in names

        chosen = policies.Policy(f"{fitting}+{k}", saves)
        graph = rewrite(base, chosen)
        p = plan(graph)
        if p.total <= budget:
            _cache(model, shape)[chosen.name] = graph  # so that `build` finds the chosen one
            best, lo = (chosen.name, p), k + 1
        else:
            hi = k - 1
    return best


def _nbytes(n) -> int:
    val = n.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _refuse(model: nn.Module, shape: StepShape, budget: int, found: dict[str, Plan]) -> None:
    for name in LADDER:
        found.setdefault(name, plan(build(model, shape, name)))
    smallest = min(found, key=lambda k: found[k].total)
    figures = ", ".join(f"recompute {k}: {mib(p.total)} (graph {mib(p.graph)})" for k, p in found.items())
    fixed = found[smallest].total - found[smallest].graph - found[smallest].cache
    raise GateRefused(
        f"refused: the job needs more than the memory budget {mib(budget)} ({figures}); the smallest plan "
        f"remat can make is {smallest} at {mib(found[smallest].total)}, of which parameters, grads and "
        f"optimizer take {mib(fixed)}: lower --ctx or --batch, use --recompute on, or raise --memory-budget",
        {k: p.as_dict() for k, p in found.items()})


def lora_settings(s: TrainSettings) -> adapters.LoraSettings | None:
    """The adapter the settings ask for; None for full fine-tuning."""
    return adapters.LoraSettings(s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_targets) if s.lora else None


def planning_model(config, s: TrainSettings) -> nn.Module:
    """The model as training would hold it, built on fake tensors: shapes and dtypes, no weights."""
    model: nn.Module
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = models.build_from_config(config, seed=s.seed)
    lora = lora_settings(s)
    if lora is not None:  # outside the fake mode: PEFT cannot swap fake weights, and the adapter is small
        model = adapters.apply_lora(model, lora, seed=s.seed)
    return model


def plan_settings(s: TrainSettings, which: tuple[str, ...] = ("off", "on")) -> dict[str, Plan]:
    """Plans from the model's config alone: nothing of the model's size is allocated."""
    return plans(planning_model(models.load_config(s.model), s), StepShape.of(s), which)
