"""Recompute policies and the budget gate: every policy trains exactly like the model's own backward.

The oracle is plain autograd through the model's forward (`Case.eager`), not another remat mode;
recompute runs the same ops on the same inputs, so on CPU the results are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from remat import policies, step
from remat.plan import measure, plan
from remat.recompute import keep_reasons, must_keep, rewrite, saved_nodes
from remat.settings import GateRefused

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = ("dots", "on", "every:2")


@pytest.mark.parametrize("name", POLICIES)
def test_policy_is_bitwise_the_models_own_backward(case, name):
    rt = rewrite(case.tg, policies.parse(name))
    loss, grads = case.run(rt)
    eager_loss, eager_grads = case.eager
    off_loss, off_grads = case.run(case.tg)
    assert torch.equal(loss, eager_loss) and torch.equal(loss, off_loss)
    for g, e, o in zip(grads, eager_grads, off_grads, strict=True):
        assert torch.equal(g, e) and torch.equal(g, o)


def test_mandatory_rules_win_over_any_policy(case):
    """A policy only decides among values the rules leave free: saving nothing still keeps the rules' set."""
    nothing = policies.Policy("nothing", lambda n: False)
    assert keep_reasons(case.tg, nothing) == must_keep(case.tg)
    everything = policies.Policy("everything", lambda n: True)
    saved = set(saved_nodes(case.tg))
    assert saved <= set(keep_reasons(case.tg, everything))


def test_policies_nest_and_plan_in_order(get_case):
    """dots saves a superset of on's set, so it plans at least as much memory, and both under off."""
    c = get_case("tiny-llama")
    saved = saved_nodes(c.tg)
    kept = {name: {n for n in saved if n in keep_reasons(c.tg, policies.parse(name))} for name in ("dots", "on")}
    assert kept["on"] < kept["dots"]
    graphs = {name: plan(rewrite(c.tg, policies.parse(name))).graph for name in ("dots", "on")}
    assert graphs["on"] < graphs["dots"] < plan(c.tg).graph


def test_every_k_keeps_every_kth_mark(get_case):
    c = get_case("tiny-llama", num_layers=4)
    kept = [n.args[1] for n, why in keep_reasons(c.tg, policies.parse("every:2")).items() if why == "every:2"]
    assert sorted(kept) == ["l_out.1", "l_out.3"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown recompute policy"):
        policies.parse("every:0")


def test_budget_picks_a_plan_that_fits_and_runs_as_planned(get_case):
    c = get_case("tiny-qwen35")
    shape = step.StepShape("window", c.ids.shape[0], c.ids.shape[1], None, 0)
    model = c.model
    ladder = step.plans(model, shape, step.LADDER)
    low, high = ladder["on"].total, ladder["off"].total
    budgets = [low + (high - low) * f // 6 for f in range(6)]  # from the smallest plan to just under off
    chosen = set()
    for budget in budgets:
        choice = step.choose(model, shape, "budget", budget)
        assert choice.plan.total <= budget, (budget, choice.policy)
        chosen.add(choice.policy)
        graph = step.build(model, shape, choice.policy)  # what the trainer runs: the graph planned
        (loss, *grads), measured = measure(graph, c.args())
        assert measured.graph == choice.plan.graph
        assert torch.equal(loss, c.eager[0]) and all(torch.equal(a, b) for a, b in zip(grads, c.eager[1]))
    assert len(chosen) >= 3, chosen  # the budget changes the answer, between the built-ins too


def test_budget_below_the_smallest_plan_is_refused_with_it(get_case):
    c = get_case("tiny-llama")
    shape = step.StepShape("window", c.ids.shape[0], c.ids.shape[1], None, 0)
    smallest = min(p.total for p in step.plans(c.model, shape, step.LADDER).values())
    with pytest.raises(GateRefused, match=f"smallest plan remat can make is on at {smallest / 2**20:,.1f} MiB"):
        step.choose(c.model, shape, "budget", smallest - 1)
    assert step.choose(c.model, shape, "auto", smallest).policy == "on"
