"""The step, built in one place: a `Planner` traces (and rewrites) a model's train step once per shape and
policy, plans it, and chooses the policy that fits a budget.

The trainer, `remat plan`, `remat verify`, the bench and the server's `/train` all get their graphs and plans from
a planner, so a setting changes the graph the same way everywhere. Its caches are its own fields, held by its
owner (the trainer: one per run; the server: one per LoRA shape); nothing is kept on the model.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.base import collector
from remat.base.settings import GateRefused, TrainSettings, UsageError
from remat.core import devices, offload, policies, precision
from remat.core.graph import TrainGraph
from remat.core.plan import PIECE, Plan, mib, placed, plan, rank_share
from remat.core.recompute import Rewriter, keep_reasons, saved_nodes
from remat.fastplan import pieces, record, stamp
from remat.models import stored
from remat.models.hf import causal_lm, loss_chunk_for
from remat.models.hf_cache import Probes
from remat.models.steps import chunk_inputs, chunk_step, window_step


@dataclass(frozen=True)
class StepShape:
    """What fixes the traced graph: the path, the batch and window (or chunk) shape, and the loss pieces."""

    path: str  # "window" or "walk"
    batch: int
    ctx: int
    ubatch: int | None  # walk: tokens per chunk
    loss_chunk: int | None  # None: the model's (`hf.loss_chunk_for`), settled by the planner
    walk: str | None = None  # walk: "exact" or "truncated"
    updates: bool = False  # the optimizer runs in the backward (`training.in_backward`): the same trace, planned so
    dtype: str = "float32"  # what the step computes in (`remat.core.precision`), `auto` resolved

    @classmethod
    def of(cls, s: TrainSettings) -> StepShape:
        on_walk = s.path == "walk"
        return cls(s.path, s.batch, s.ctx, s.ubatch if on_walk else None, s.loss_chunk, s.walk if on_walk else None,
                   in_backward(s), precision.resolve(s.dtype, s.device).name)

    @property
    def compute(self) -> torch.dtype:
        return precision.DTYPES[self.dtype]


def in_backward(s: TrainSettings, world_size: int = 1) -> bool:
    """Whether the job's optimizer runs in the backward (`training.in_backward`): `on`. Where it does not apply,
    `on` is refused in one line (`not_in_backward` says why). `auto` is the gate's to settle (`gate.admit`: in the
    backward only where the job fits no other way); until then it is planned after the backward."""
    why = not_in_backward(s, world_size)
    if s.optimizer_in_backward == "on" and why:
        raise UsageError(f"--optimizer-in-backward on does not apply: {why}")
    return s.optimizer_in_backward == "on"


def may_run_in_backward(s: TrainSettings, world_size: int = 1) -> bool:
    """Whether `auto` may put the job's optimizer in the backward: full fine-tuning where it applies."""
    return s.optimizer_in_backward == "auto" and not s.lora and not_in_backward(s, world_size) is None


def not_in_backward(s: TrainSettings, world_size: int = 1) -> str | None:
    """Why the optimizer cannot run in the backward for this job (one line), or None."""
    if s.accumulate > 1:
        return f"--accumulate {s.accumulate} sums several windows' gradients before the update"
    if s.path == "walk":
        return "the walk adds every chunk's gradient into one sum before the update"
    if world_size > 1:
        return "several ranks average their gradients (all-reduce) before the update"
    return None


def policy_name(policy: str | bool) -> str:
    """The canonical name: "on" for the per-layer policy (also spelled "layer" or True), "off" for False."""
    if isinstance(policy, bool):
        return "on" if policy else "off"
    return "on" if policy == "layer" else policy


# The policies that save alike in every layer: a stamped step's plans under them are stamped too (`_planned`).
LAYERS_ALIKE = ("off", "dots", "on")

# From most memory (fastest) to least; each saves a subset of what the one before it saves. every:K recomputes
# the marks between its kept ones as second-level checkpoints, and each layer from the mark below (Chen et al.),
# so it plans below "on" for K up to about sqrt(layers).
LADDER = ("off", "dots", "on", "every:2", "every:4")
# On a device: the marks kept in host memory (`offload`) cost copies alone, so that rung comes before every:K's
# recompute. It saves what `on` saves (on the device: nothing across the backward).
DEVICE_LADDER = ("off", "dots", "on", "offload", "every:2", "every:4")


@dataclass
class Choice:
    """The gate's answer: the policy that runs, why, and the plans it looked at."""

    policy: str
    reason: str
    plans: dict[str, Plan]

    @property
    def plan(self) -> Plan:
        return self.plans[self.policy]


@dataclass
class _Shape:
    """What a planner keeps for one shape of step (and set of trainable parameters)."""

    graphs: dict[str, TrainGraph] = field(default_factory=dict)  # by policy name
    plans: dict[tuple[str, bool], Plan] = field(default_factory=dict)  # by policy name and `updates`, one process
    rewriter: Rewriter | None = None  # every policy's rewrite, and each probe of a budget search, shares it
    stamper: stamp.Stamper | None = None  # a planning model's step stamped from a few layers
    stamped: bool = False  # the stamper was asked for (None: the step does not stamp)
    saved_back: dict[str, policies.Policy] = field(default_factory=dict)  # policies `choose` made, by name
    all_pieces: bool = False  # a planning model's step with each loss piece its own graph (a save-back's choice)


class Planner:
    """One model's steps: `build` (trace, rewrite), `plans`, `choose` (the gate's policy), each shape's made once.

    Every step is recorded without make_fx's proxies (`remat.fastplan.record`); a model with fake weights
    (`gate.planning_model`: only planned, never run) is stamped from a few of its layers too (`remat.fastplan`).
    A new batch shape is a new step, traced on first use; `forget_graphs` drops the graphs and keeps the plans
    (a server asked for shape after shape).
    """

    def __init__(self, model: nn.Module, device: torch.device | None = None):
        self.model = model
        # where the step runs: traced for it (its kernels), planned on it (its memory split from the host's)
        self.device = device or next(model.parameters()).device
        self.ladder = LADDER if devices.is_host(self.device) else DEVICE_LADDER
        self.planning = any(isinstance(p, FakeTensor) for p in model.parameters())
        # the walk's: what running the model taught about its states (planning: running the layers a stamp traces)
        self.probes = Probes(model, stamp.stand_ins(model) if self.planning else None)
        self.picked: stamp.Picked | None = None  # the layers a stamp traces, picked once per model
        self._shapes: dict[tuple, _Shape] = {}
        self.stored = any(stored.stored(model))  # quant: weights held as stored, made float in the step

    def _at(self, shape: StepShape) -> _Step:
        """The step of this shape (`_key`: worked out once per call, a walk over every module)."""
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        shape, key = self._key(shape, [n for n, _ in trainable])
        return _Step(shape, self._shapes.setdefault(key, _Shape()), [p.numel() for _, p in trainable], self.device)

    def _key(self, shape: StepShape, trainable: list[str]) -> tuple[StepShape, tuple]:
        """The shape with its loss chunk settled, and what its step is kept by: that shape (the optimizer's place
        changes the plan, not the trace) and the names of the parameters it trains."""
        if shape.loss_chunk is None:
            shape = dataclasses.replace(shape, loss_chunk=loss_chunk_for(causal_lm(self.model).config,
                                                                         walk=shape.path == "walk"))
        return shape, (dataclasses.replace(shape, updates=False), tuple(trainable))

    @collector.paused
    def build(self, shape: StepShape, policy: str | bool) -> TrainGraph:
        """The traced (and, unless the policy is "off", rewritten) step, traced once: an epoch, every chunk of a
        walk, and the plans of every policy reuse one trace. `policy` names a recompute policy
        (`remat.core.policies`: off, on/layer, dots, every:K, or one that `choose` made); True is "on", False "off".
        """
        return self._build(self._at(shape), policy_name(policy))

    def _build(self, at: _Step, name: str) -> TrainGraph:
        graphs = at.kept.graphs
        if name not in graphs:
            chosen = at.kept.saved_back.get(name) or self._policy(name, at.shape)
            graphs[name] = self._traced_step(at) if chosen is None else self._rewriter(at)(chosen)
            if chosen is not None and offload.applies(chosen, self.device):  # the checkpoints kept in host memory
                graphs[name] = offload.apply(graphs[name], chosen, self.device)
        return graphs[name]

    def _policy(self, name: str, shape: StepShape) -> policies.Policy | None:
        """The policy named; for off, None (the trace as it is), but where the step makes weights float (stored
        ones, quant) or casts them (a compute dtype other than float32) the trace rewritten to recompute those copies
        alone (`policies.always_recomputed`)."""
        recast = self.stored or shape.dtype != "float32"  # weights made float, or cast, in the step
        return policies.parse(name) or (policies.everything() if recast else None)

    def _traced_step(self, at: _Step) -> TrainGraph:
        """The step as traced, before any rewrite (a float model's off)."""
        if "traced" not in at.kept.graphs:
            at.kept.graphs["traced"] = self._trace(at)
        return at.kept.graphs["traced"]

    def _rewriter(self, at: _Step) -> Rewriter:
        if at.kept.rewriter is None:
            at.kept.rewriter = Rewriter(self._traced_step(at))
        return at.kept.rewriter

    def forget_graphs(self, but: tuple[StepShape, ...] = ()) -> None:
        """Drop the traced steps and keep their plans: a shape asked again is answered from them, and one whose
        graph is needed again (a budget search, a policy not planned yet) is traced again. A server plans each new
        shape a client asks for: kept, every one's graphs (tens of MiB, ~10^5 objects each) would stay, and every
        full collection would walk them. `but`: the graphs of these shapes are kept."""
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        keep = {self._key(shape, trainable)[1] for shape in but}
        for key, kept in self._shapes.items():
            if key in keep:
                continue
            kept.graphs.clear()
            kept.rewriter, kept.stamper, kept.stamped = None, None, False

    def keep_only(self, shape: StepShape, policy: str) -> TrainGraph:
        """The step that will run, alone: the other graphs (the trace, other policies', the rewriter) dropped, the
        plans kept. A run holds its one graph; the others were only planned (SmolLM2's demo: ~60 MiB each)."""
        graph = self.build(shape, policy)
        self.forget_graphs()
        self._at(shape).kept.graphs[policy_name(policy)] = graph
        return graph

    def _trace(self, at: _Step) -> TrainGraph:
        if at.kept.all_pieces:
            return self._all_pieces(at)
        stamper = self._stamper(at, graph=True)
        if stamper is not None:
            return stamper.graph()
        return self._chunk(at.shape) if at.shape.path == "walk" else self._traced(at.shape)

    def _chunk(self, shape: StepShape, layers: tuple[int, ...] | None = None) -> TrainGraph:
        """A walk chunk's step traced whole, or with only `layers` (a stamp's small trace)."""
        assert shape.ubatch is not None and shape.loss_chunk is not None  # settled by `_at`
        return chunk_step(self.model, shape.batch, shape.ctx, shape.ubatch, loss_chunk=shape.loss_chunk,
                          exact=shape.walk != "truncated", probes=self.probes, recorder=record.record,
                          device=self.device, dtype=shape.compute, layers=layers)

    def _traced(self, shape: StepShape, lumped: bool = True) -> TrainGraph:
        """The step traced whole; on fake weights (only planned, never run) with its loss's pieces stamped
        (`lumped`: a few of them, standing for the rest in its plans; else all)."""
        ids = torch.zeros(shape.batch, shape.ctx, dtype=torch.long)
        chunk = shape.loss_chunk
        assert chunk is not None  # settled by `_at`

        def whole() -> TrainGraph:  # two tensors: two inputs
            return window_step(self.model, ids, ids.clone(), loss_chunk=chunk, recorder=record.record,
                               device=self.device, dtype=shape.compute)

        if self.planning:
            with contextlib.suppress(stamp.NotStampable):
                return pieces.stamp(whole, shape.ctx, chunk, lumped)
        return whole()

    def _all_pieces(self, at: _Step) -> TrainGraph:
        """The planned step with every loss piece a graph of its own, where its plans' step stands some for others
        (`pieces.stamp`'s `lumped`): a save-back choosing among the pieces' values chooses as the step that runs."""
        if self._stamper(at) is None:
            return self._traced(at.shape, lumped=False)
        return stamp.stamp(self.model, lambda layers: self._traced(at.shape, lumped=False), self.picked).graph()

    def _stamper(self, at: _Step, graph: bool = False) -> stamp.Stamper | None:
        """The step of a planning model stamped from a few of its layers' trace (`remat.fastplan.stamp`), made
        once per shape (`graph`: for its whole graph, made with it); None where it is traced whole (a model whose
        layers do not stamp). A walk's small trace holds its layers' states alone; the whole step's inputs hold
        every layer's."""
        kept, shape = at.kept, at.shape
        if not kept.stamped:
            kept.stamped = True
            if self.planning:
                with contextlib.suppress(stamp.NotStampable):
                    if shape.path == "walk":
                        assert shape.ubatch is not None
                        states = self.probes.state_shapes(shape.batch, shape.ctx)  # the whole model's: before the cut
                        inputs = chunk_inputs(self.model, states, shape.batch, shape.ubatch, shape.walk != "truncated",
                                             shape.compute)
                        kept.stamper = stamp.stamp(self.model, lambda layers: self._chunk(shape, layers), self.picked,
                                                   inputs, graph)
                    else:
                        kept.stamper = stamp.stamp(self.model, lambda layers: self._traced(shape), self.picked,
                                                   graph=graph)
                    self.picked = kept.stamper.picked
        return kept.stamper

    @collector.paused
    def plans(self, shape: StepShape, which: tuple[str, ...] = ("off", "on"), world_size: int = 1) -> dict[str, Plan]:
        """The memory plan of the step under each policy named (off, on, layer, dots, every:K), for one of
        `world_size` data-parallel ranks (its share of the optimizer state)."""
        at = self._at(shape)
        return {k: self._plan(at, k, world_size) for k in which}

    def _plan(self, at: _Step, policy: str, world_size: int) -> Plan:
        """`plan(build(shape, policy))`, made once; a rewrite not made yet is planned without making it. A copy:
        the trainer fills in what it measures."""
        key = policy_name(policy), at.shape.updates
        if key not in at.kept.plans:
            at.kept.plans[key] = self._planned(at, key[0])
        return at.rank(at.kept.plans[key], world_size)

    def _planned(self, at: _Step, name: str) -> Plan:
        updates = at.shape.updates
        if name in at.kept.graphs:  # a graph already made
            return plan(self._build(at, name), updates=updates)
        chosen = at.kept.saved_back.get(name) or self._policy(name, at.shape)
        if offload.applies(chosen, self.device):  # a pass on the made graph: planned from it
            return plan(self._build(at, name), updates=updates)
        stamper = self._stamper(at) if name in LAYERS_ALIKE else None
        if stamper is not None:  # planned from the few layers traced, rewritten: no graph of the whole step
            with contextlib.suppress(stamp.NotStampable):
                return stamper.plan(chosen, updates)
        # off; else a rewrite planned without making it
        return plan(self._build(at, name), updates=updates) if chosen is None else self._rewriter(at).plan(
            chosen, updates=updates)

    @collector.paused
    def choose(self, shape: StepShape, recompute: str, budget: int, world_size: int = 1,
               host: int | None = None) -> Choice:
        """The fastest plan that fits `budget` among those `recompute` allows, or GateRefused.

        A named policy is taken as it is. "auto" tries no recompute first; "budget" starts with the
        built-ins from the fastest down (`LADDER`, without off), takes the first that fits, then saves back
        what the next faster one saves (for dots: off, everything), the values most expensive to recompute
        per byte first (FLOPs, `policies.recompute_cost`), while the plan still fits.

        On a device, `budget` is the device's memory (a plan's `total`) and `host`, where given, the host's beside
        it (a plan's `host`), and the ladder has `offload` after `on` (`DEVICE_LADDER`).
        """
        at = self._at(shape)
        choice = self._choose(at, recompute, budget, world_size, host)
        for name in ("off", "on"):  # shown beside the choice: what recompute saves (or costs) on this job
            choice.plans.setdefault(name, self._plan(at, name, world_size))
        return choice

    def _choose(self, at: _Step, recompute: str, budget: int, world_size: int, host: int | None) -> Choice:
        def fits(p: Plan) -> bool:
            return p.total <= budget and (host is None or p.host <= host)

        if recompute not in ("auto", "budget"):
            name = policy_name(recompute)
            named = {name: self._plan(at, name, world_size)}
            if fits(named[name]):
                return Choice(name, f"plan {mib(named[name].total)} fits the budget {mib(budget)}", named)
            self._refuse(at, budget, named, world_size)
        ladder = self.ladder if recompute == "auto" else self.ladder[1:]
        found: dict[str, Plan] = {}
        for name in ladder:
            found[name] = self._plan(at, name, world_size)
            if fits(found[name]):
                break
        else:
            self._refuse(at, budget, found, world_size)
        if name == "off":
            return Choice(name, f"recompute not needed: plan {mib(found[name].total)} fits the budget "
                          f"{mib(budget)}", found)
        over = [k for k in ladder if k != name and k in found]  # the faster built-ins: none fits
        faster = self.ladder[self.ladder.index(name) - 1]  # the next faster one: over the budget, or off (untried)
        refined = self._save_back(at, budget, faster, name, found[name], world_size)
        if refined is not None:
            name, found[name] = refined
        if not over:
            return Choice(name, f"{name} plans {mib(found[name].total)}, within the budget {mib(budget)}", found)
        figures = ", ".join(f"{k} plans {mib(found[k].total)}" + (
            f" (host {mib(found[k].host)}, over the host's {mib(host)})" if host is not None and found[k].host > host
            else "") for k in over)
        return Choice(name, f"{figures}: over the budget {mib(budget)}; {name} plans {mib(found[name].total)}",
                      found)

    def _save_back(self, at: _Step, budget: int, faster: str, fitting: str, fitting_plan: Plan,
                   world_size: int) -> tuple[str, Plan] | None:
        """Between two ladder rungs: save the fitting rung's set plus the values the faster one saves (off: every
        one the backward reads), the costliest to recompute per byte first, as many as fit."""
        fit = policies.parse(fitting)
        fast = policies.parse(faster) or policies.everything()
        assert fit is not None
        rewriter = self._rewriter(at)
        kept, extra = _save_back_candidates(rewriter.tg, fit, fast)
        if any(n.meta.get(PIECE, (0, 0))[1] for n in extra):  # a piece's values stand for others': each its own
            at.kept.all_pieces, at.kept.rewriter = True, None  # from now on: the policy made names their nodes
            at.kept.graphs.clear()
            rewriter = self._rewriter(at)
            kept, extra = _save_back_candidates(rewriter.tg, fit, fast)

        def saving(k: int) -> tuple[policies.Policy, dict]:
            names = frozenset(n.name for n in extra[:k])
            chosen = policies.Policy(f"{fitting}+{k}", lambda n: fit.saves(n) or n.name in names)
            return chosen, kept | dict.fromkeys(extra[:k], chosen.name)  # what keep_reasons would keep

        probed: dict[int, Plan] = {}

        def probe(k: int) -> int:  # planned without making the graph: most of a rewrite's time is making it
            probed[k] = at.rank(rewriter.plan(*saving(k), updates=at.shape.updates), world_size)
            return probed[k].total

        saved = list(itertools.accumulate(map(_nbytes, extra), initial=0))
        k = most_that_fit(saved, probe, budget, fitting_plan.total)
        if k == 0:
            return None
        chosen = saving(k)[0]
        at.kept.saved_back[chosen.name] = chosen  # `build` makes its graph if it runs
        return chosen.name, probed[k]

    def _refuse(self, at: _Step, budget: int, found: dict[str, Plan], world_size: int) -> None:
        for name in self.ladder:
            found.setdefault(name, self._plan(at, name, world_size))
        smallest = min(found, key=lambda k: found[k].total)
        figures = ", ".join(f"recompute {k}: {mib(p.total)} (graph {mib(p.graph)})" for k, p in found.items())
        fixed = found[smallest].total - found[smallest].graph - found[smallest].cache
        of = "" if devices.is_host(self.device) else f" of {self.device}"
        raise GateRefused(
            f"refused: the job needs more than the memory budget{of} {mib(budget)} ({figures}); the smallest plan "
            f"remat can make is {smallest} at {mib(found[smallest].total)}, of which parameters, grads and "
            f"optimizer take {mib(fixed)}: lower --ctx or --batch, use --recompute {smallest}, or raise "
            "--memory-budget", {k: p.as_dict() for k, p in found.items()})


@dataclass
class _Step:
    """One call's step: its shape, what the planner keeps for it, and its trainable tensors' sizes."""

    shape: StepShape
    kept: _Shape
    numels: list[int]
    device: torch.device

    def rank(self, p: Plan, world_size: int) -> Plan:
        """A copy of `p` for one of `world_size` ranks (its share of the optimizer state), on the step's device."""
        return placed(rank_share(p, self.numels, world_size) if world_size > 1 else dataclasses.replace(p),
                      self.device)


def most_that_fit(saved: list[int], probe: Callable[[int], int], budget: int, start: int) -> int:
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


def _save_back_candidates(tg: TrainGraph, fit: policies.Policy,
                          fast: policies.Policy) -> tuple[dict, list]:
    """What `fit` keeps (`keep_reasons`), and the values `fast` saves besides, the costliest to recompute per byte
    first."""
    kept = keep_reasons(tg, fit)
    extra = [n for n in saved_nodes(tg) if n not in kept and fast.saves(n)
             and not policies.always_recomputed(n)]  # quant: no float copy of a stored weight is saved back
    extra.sort(key=lambda n: -policies.recompute_cost(n) / max(1, _nbytes(n)))
    return kept, extra


def _nbytes(n) -> int:
    val = n.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
