"""The longest window a job fits in its budget (`remat plan --ctx max`, `POST /train/plan` with `"ctx": "max"`).

For each path (the window; the walk, in multiples of `--ubatch`) the longest window the gate admits, found by
planning alone (fake weights, nothing of the model's size allocated): a window fits when the smallest plan the
job's `--recompute` allows is within the budget (what the gate asks, `Planner.choose`: a save-back only adds to a
rung that fits). Plans grow with the window nearly in a line (the walk's exactly: every size in a chunk's step is
the cache's length times a constant, plus one; a window's with a part that grows with its square), so each probe
goes where the line or the quadratic through the probes nearest the budget meets it (`search`), and the answer is
confirmed: the window named fits, the next allowed one does not,
unless the model's maximum context is the limit. Where what every window holds (the weights, the optimizer's
state) is over the budget on its own, the first probe says so. The gate's own answer at that window (its policy
and plans) comes with it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from remat.base.settings import GateRefused, MiB, TrainSettings, UsageError
from remat.core.plan import Plan
from remat.models import delta_rule
from remat.models import load as models
from remat.models.hf import UnsupportedModel
from remat.training import gate
from remat.training.step import LADDER, StepShape, policy_name

START = 8192  # the first window probed, unless the model's maximum is shorter (2048 took 1-3 probes more)


@dataclass
class Longest:
    """One path's answer: the longest window that fits (None: not even the shortest), whether the model's maximum
    context is the limit, the gate's answer there, and the windows planned (window: its smallest plan's total among
    the policies planned there)."""

    path: str
    ctx: int | None
    step: int  # the windows this path allows are its multiples
    limit: int  # the model's maximum context, in multiples of `step`
    admitted: gate.Admitted | None = None
    next_total: int | None = None  # the smallest plan of the next allowed window (not capped)
    probes: dict[int, int] = field(default_factory=dict)
    reason: str = ""  # where the path cannot run, or nothing fits, why

    @property
    def capped(self) -> bool:
        return self.ctx is not None and self.ctx == self.limit

    def line(self) -> str:
        """The answer in one line, as `remat plan --ctx max` prints it."""
        if self.ctx is None or self.admitted is None:
            return f"{self.path}: {self.reason}"
        a = self.admitted
        text = f"{self.path}: {self.ctx:,} tokens (recompute {a.policy}, plan {a.plan.total / MiB:,.1f} MiB)"
        if self.capped:
            return text + ", the model's maximum context"
        over = (self.next_total or 0) - a.budget.bytes
        return text + f"; {self.ctx + self.step:,} would plan {over / 1024:,.1f} KiB over the budget"

    def as_dict(self) -> dict:
        a = self.admitted
        return {"path": self.path, "ctx": self.ctx, "step": self.step, "max_ctx": self.limit, "capped": self.capped,
                "policy": a.policy if a else None, "reason": a.choice.reason if a else self.reason,
                "plan": a.plan.as_dict() if a else None,
                "plans": {k: p.as_dict() for k, p in a.plans.items()} if a else {},
                "next": None if self.ctx is None or self.capped else {"ctx": self.ctx + self.step,
                                                                       "total": self.next_total},
                "optimizer": a.updates_note() if a else None, "probes": len(self.probes)}


def summary(s: TrainSettings, budget: gate.Budget, answers: list[dict], max_ctx: int, world_size: int = 1) -> dict:
    """The answers (`Longest.as_dict`) as `remat plan --ctx max --json` prints them (and `POST /train/plan` with
    `"ctx": "max"`)."""
    return {"model": s.model or "default", "ctx": "max", "budget": budget.bytes, "budget_source": str(budget),
            "max_ctx": max_ctx, "lora": s.lora, "world_size": world_size,
            "paths": {a["path"]: a for a in answers}}


Turn = Callable[[], contextlib.AbstractContextManager]


PATHS = ("window", "walk")


def longest(s: TrainSettings, budget: gate.Budget, planners: gate.Planners, world_size: int = 1,
            turn: Turn = contextlib.nullcontext, paths: tuple[str, ...] = PATHS) -> list[Longest]:
    """The longest window of the job `s` (its ctx aside) within `budget`, on each of `paths` (the window path;
    the walk). Each probe (and the gate's answer at the end) plans inside its own `turn()` (a server's: its
    planning lock, taken per probe, so that other planning and training go on between probes; the planners' state
    is whole between them: a plan, once made, is kept by its shape)."""
    limit = models.max_ctx(planners.config)
    return [_path(s, path, 1 if path == "window" else s.ubatch, limit, budget, planners, world_size, turn)
            for path in paths]


def _path(s: TrainSettings, path: str, step: int, limit: int, budget: gate.Budget, planners: gate.Planners,
          world_size: int, turn: Turn) -> Longest:
    """One path's answer. Of the probes' graphs only the longest fitting window's and the last probe's are kept
    until it is found (the gate plans the window found again, and the window after it is planned again, with the
    policies the search did not need: from the same small trace), then dropped (other planning between probes may
    drop them sooner: what it needs again is traced again, the plans kept). Every probe's kept, a search held
    gigabytes (qwen3.5-0.8b's window near 80k tokens, before its loss pieces were lumped: 6.9 GB)."""
    try:
        return _search_path(s, path, step, limit, budget, planners, world_size, turn)
    finally:
        with turn():
            planners.forget_graphs()


def _search_path(s: TrainSettings, path: str, step: int, limit: int, budget: gate.Budget, planners: gate.Planners,
                 world_size: int, turn: Turn) -> Longest:
    answer = Longest(path, None, step, limit // step * step)
    if answer.limit < step:
        answer.reason = f"the model's maximum context {limit:,} is below one chunk of {step:,}"
        return answer
    allowed = _allowed(s.recompute)

    def at(ctx: int) -> TrainSettings:
        return gate.settled(s.model_copy(update={"ctx": ctx, "path": path}), planners.config, world_size)

    lead = allowed[0]  # the policy the search plans: the smallest at the last window planned under every one
    lead_plan: Plan | None = None  # the lead's plan there
    fits: tuple[int, StepShape | None] = (0, None)  # the longest window planned within the budget, and its shape

    def smallest(ctx: int, policies: tuple[str, ...] = allowed) -> int:
        nonlocal lead, lead_plan, fits
        t = at(ctx)
        if t.optimizer_in_backward == "auto":  # the job as small as it runs: in the backward where only so it fits
            t = t.model_copy(update={"optimizer_in_backward": "on"})
        with turn():
            plans = planners.planner(t, budget).plans(StepShape.of(t), policies, world_size)
        best = min(plans, key=lambda k: plans[k].total)
        answer.probes[ctx] = min(answer.probes.get(ctx, plans[best].total), plans[best].total)
        if answer.probes[ctx] <= budget.bytes and ctx >= fits[0]:
            fits = ctx, StepShape.of(t)
        with turn():  # the last probe's graphs (the answer's next, planned again) and the longest fitting one's
            planners.forget_graphs(but=tuple(shape for shape in (fits[1], StepShape.of(t)) if shape is not None))
        if policies == allowed:
            lead, lead_plan = best, plans[best]
        return plans[best].total

    # The search plans one policy a window (the smallest where every one was planned); the window after the one
    # found (or the first, where none was) is planned under every policy allowed, and where one fits there the
    # search goes on from it, led by that one.
    found, start, floor = None, min(START, answer.limit) // step * step, 0
    try:
        smallest(start)
        if reason := _held_over(lead_plan, budget):  # said at once, not after probing down to the shortest window
            answer.reason = reason
            return answer
        with turn():
            pieces = 0 if path == "walk" else _period(at(start), planners.planner(at(start), budget).model)
        while True:
            more = search(lambda ctx: smallest(ctx, (lead,)), budget.bytes, step, answer.limit, start,
                          _fixed(lead_plan), period=pieces, floor=floor)
            found = more or found
            if more == answer.limit or smallest(step if more is None else more + step) > budget.bytes:
                break
            start = floor = step if more is None else more + step  # where the new lead fits
    except (UnsupportedModel, GateRefused, UsageError) as e:
        answer.reason = f"cannot run: {e}"
        return answer
    if found is None:
        answer.reason = f"no window fits: {step:,} tokens are over the budget {budget}"
        return answer
    answer.ctx, answer.next_total = found, answer.probes.get(found + step)
    with turn():
        answer.admitted = gate.admit(at(found), budget, world_size=world_size, planners=planners)
    return answer


def _period(s: TrainSettings, model: nn.Module) -> int:
    """Where a window's plan jumps: one token past each multiple of the loss chunk (one loss piece more) and of the
    model's own chunks of tokens (`delta_rule.chunk_sizes`: qwen3.5's 64, where the loss's are 32), so one past each
    multiple of their least common multiple (0: none)."""
    return math.lcm(s.loss_chunk, *delta_rule.chunk_sizes(model)) if s.loss_chunk else 0


def _fixed(p: Plan | None) -> int:
    """What no window changes (the weights and the optimizer's state): the search's first guess leaves it."""
    return 0 if p is None else p.params + p.frozen + p.optimizer


def _held_over(p: Plan | None, budget: gate.Budget) -> str:
    """Why no window fits where what every window's plan holds beside its step and the walk's cache is over the
    budget on its own (else "")."""
    held = 0 if p is None else p.total - max(p.step + p.cache, p.grads + p.workspace)
    if held <= budget.bytes:
        return ""
    return (f"no window fits: what every window holds (the weights, the optimizer's state) plans {held / MiB:,.1f} "
            f"MiB, over the budget {budget}")


def _allowed(recompute: str) -> tuple[str, ...]:
    """The policies whose smallest plan decides whether a window fits: the named one, or the ladder's below dots
    (off and dots save more than on: never smaller)."""
    if recompute in ("auto", "budget"):
        return tuple(p for p in LADDER if p not in ("off", "dots"))
    return (policy_name(recompute),)


def search(total: Callable[[int], int], budget: int, step: int, limit: int, start: int, fixed: int = 0,
           period: int = 0, floor: int = 0) -> int | None:
    """The largest multiple of `step` in [step, limit] whose `total` is within `budget`, plans growing with the
    window (None: not even `step`), in few probes (`_bracket`). `fixed`: the part of a plan no window changes (the
    first guess leaves it). `period`: the plan jumps one window past each multiple of it (a loss piece more), so
    the search runs over its multiples first, then within the one stretch after the last that fits, where the plan
    is a line. `floor`: a window known to fit (0: none)."""
    seen: dict[int, int] = {}

    def probe(ctx: int) -> int:
        if ctx not in seen:
            seen[ctx] = total(ctx)
        return seen[ctx]

    if not (period > step and period % step == 0 and limit >= period):
        return _bracket(probe, budget, step, limit, max(step, start), fixed)
    if start >= limit and probe(limit) <= budget:
        return limit
    ends = _bracket(probe, budget, period, limit // period * period, max(period, start // period * period), fixed,
                    past=lambda c: probe(c + step) > budget)
    lo = max(ends or 0, floor)
    last = min((ends or 0) + period, limit)  # the stretch's last window: over the budget, or the model's maximum
    if lo + step > last or (lo + step not in seen and last == limit and probe(last) <= budget):
        return last
    if probe(lo + step) > budget:
        return lo or None
    if probe(last) <= budget:
        return last
    return _bracket(probe, budget, step, last, lo + step, fixed, (lo + step, last))


def _bracket(probe: Callable[[int], int], budget: int, step: int, limit: int, start: int, fixed: int = 0,
             ends: tuple[int, int] | None = None, past: Callable[[int], bool] | None = None) -> int | None:
    """`search`'s probes, from `start`, or between `ends` (the first fits, the last does not). The second probe is
    the first's window in proportion to the budget (of what grows with the window: all but `fixed`); then each goes
    where a line through two probes meets it, or the quadratic through three (`_line`), kept inside the bracket;
    where two probes did not halve the bracket, or the line was held at its edge twice running (a plan that jumps:
    a window a probe), a bisection. Mostly three to six probes. `past(lo)`: whether what lies past a window that
    fits is over the budget, so it is the answer, asked where the line through two probes over the budget (which
    meets it at or past the answer) puts the answer within a step of it (a search over whole loss pieces: one
    token more is one piece more, and often what goes over)."""
    seen = {c: probe(c) for c in ends or ()}  # this search's own: a line is drawn through them alone
    lo, hi = ends or (0, limit + step)  # lo fits (0: none yet), hi does not (past the limit: none yet)
    ctx, widths = start, list[int]()  # the bracket's widths, once it has both ends
    edge = jumps = False  # the last probe was the line's, held at the bracket's edge; twice so: the plan jumps
    while True:
        seen[ctx] = probe(ctx)
        if seen[ctx] <= budget:
            lo = ctx
        else:
            hi = ctx
        if hi - lo <= step:
            return lo or None
        bracketed = lo > 0 and hi <= limit
        widths += [hi - lo] if bracketed else []
        line = min(max(_line(seen, budget, step, limit, fixed), lo + step), hi - step)
        if past is not None and ctx == lo and line == lo + step and _over_line(seen, budget) and past(lo):
            return lo
        stalled = len(widths) > 2 and widths[-1] > widths[-3] // 2 and line not in (lo + step, hi - step)
        jumps = jumps or (edge and line in (lo + step, hi - step))
        ctx = (lo + hi) // 2 // step * step if stalled or jumps else line
        edge = bracketed and ctx == line and line in (lo + step, hi - step)


def _over_line(seen: dict[int, int], budget: int) -> bool:
    """Whether `_line` draws its line through two probes over the budget."""
    return sum(p > budget for p in seen.values()) >= 2


def _line(seen: dict[int, int], budget: int, step: int, limit: int, fixed: int = 0) -> int:
    """Where the line through the two probes nearest the budget meets it, in multiples of `step`: the two over it
    where there are two (a plan is the larger of parts that each grow in a line or a curve, so it bends up where
    one overtakes another: the line through two probes past the bend meets the budget at or past the answer, and
    on it where the last part grows in a line), else the curve through three that grow with the window, else the
    two nearest."""
    over = sorted((c for c in seen if seen[c] > budget), key=seen.__getitem__)[:2]
    if len(over) == 2:
        (a, pa), (b, pb) = sorted((c, seen[c]) for c in over)
        if pb > pa:
            return max(step, int((a + (budget - pa) / ((pb - pa) / (b - a))) // step * step))
    curve = _curve(seen, budget)
    if curve is not None:
        return max(step, min(limit, int(curve // step * step)))
    near = sorted(seen, key=lambda c: abs(seen[c] - budget))[:2]
    if len(near) < 2:  # one probe: the window in proportion to what of the plan grows with it (all but `fixed`)
        c = near[0]
        grows = seen[c] - fixed if 0 <= fixed < min(seen[c], budget) else seen[c]
        room = budget - fixed if grows < seen[c] else budget
        return max(step, min(limit, int(c * room / grows) // step * step))
    (a, pa), (b, pb) = sorted((c, seen[c]) for c in near)
    slope = (pb - pa) / (b - a) if pb != pa else 0.0
    if slope <= 0:  # flat: the budget is not met between them; the bracket's end will be tried
        return limit if pa <= budget else step
    return int((a + (budget - pa) / slope) // step * step)


def _curve(seen: dict[int, int], budget: int) -> float | None:
    """Where the curve through the three probes nearest the budget meets it: the plan as a quadratic of the window
    (a window's plan has a part that grows with its square, the mask, and a walk's none: on a line, this is the
    line's answer), its root between the first and last of them or past them on the side the budget is. None with
    fewer than three, three not growing, or no root."""
    near = sorted(sorted(seen, key=lambda c: abs(seen[c] - budget))[:3])
    if len(near) < 3:
        return None
    (a, pa), (b, pb), (c, pc) = ((x, seen[x]) for x in near)
    if not pa < pb < pc:
        return None
    ab, bc = (pb - pa) / (b - a), (pc - pb) / (c - b)
    curv = (bc - ab) / (c - a)  # y = pa + ab (x - a) + curv (x - a)(x - b)
    # curv x^2 + (ab - curv (a + b)) x + (pa - ab a + curv a b - budget) = 0
    qa, qb, qc = curv, ab - curv * (a + b), pa - ab * a + curv * a * b - budget
    if abs(qa) < 1e-12:
        return -qc / qb if qb > 0 else None
    disc = qb * qb - 4 * qa * qc
    if disc < 0:
        return None
    roots = [(-qb + s * disc ** 0.5) / (2 * qa) for s in (1, -1)]
    rising = [r for r in roots if 2 * qa * r + qb > 0]  # where the plan grows with the window
    return rising[0] if rising else None
