"""Recompute policies and the budget gate: every policy trains exactly like the model's own backward.

The oracle is plain autograd through the model's forward (`Case.eager`), not another remat mode;
recompute runs the same ops on the same inputs, so on CPU the results are bitwise equal.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch

from planning import plan_settings, planner_of
from remat.base.settings import GateRefused, TrainSettings
from remat.core import policies
from remat.core.marks import mark_name
from remat.core.plan import measure, mib, plan
from remat.core.recompute import CLONE_OF, Rewriter, keep_reasons, must_keep, rewrite, saved_nodes
from remat.training import step

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = ("dots", "on", "every:2", "every:4")


def assert_eager(case, loss: torch.Tensor, grads: list[torch.Tensor]) -> None:
    eager_loss, eager_grads = case.eager
    assert torch.equal(loss, eager_loss)
    assert len(grads) == len(eager_grads) and all(torch.equal(g, e) for g, e in zip(grads, eager_grads))


@pytest.mark.parametrize("name", POLICIES)
def test_policy_is_bitwise_the_models_own_backward(case, name):
    rt = rewrite(case.tg, policies.parse(name))
    loss, grads = case.run(rt)
    eager_loss, eager_grads = case.eager
    off_loss, off_grads = case.run(case.tg)
    assert torch.equal(loss, eager_loss) and torch.equal(loss, off_loss)
    for g, e, o in zip(grads, eager_grads, off_grads, strict=True):
        assert torch.equal(g, e) and torch.equal(g, o)


def test_every_policy_is_bitwise_smollm2s_own_backward(get_case):
    """The real weights (the embedded SmolLM2-135M GGUF), a short window: each policy's loss and grads are
    the model's own autograd's, bit for bit."""
    c = get_case(None)  # the default model
    for name in POLICIES:
        assert_eager(c, *c.run(rewrite(c.tg, policies.parse(name))))


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


def layer_of(case) -> dict[str, str | None]:
    """Each forward node's layer: the first mark at or after it, in forward order."""
    layer, upcoming = {}, None
    for n in reversed(case.tg.forward_nodes()):
        upcoming = mark_name(n) or upcoming
        layer[n.name] = upcoming
    return layer


def test_every_k_recomputes_a_mark_once_and_the_layers_under_it_once_more(get_case):
    """Chen et al.'s two levels: every:4 on 4 layers keeps l_out.3; l_out.0-2 are recomputed once each, for the
    whole backward. A layer under a recomputed mark runs once more than the top layer: to make its mark for
    the backward of the layer above (its intermediates then die), and for its own backward, from the mark
    below, like the top layer."""
    c = get_case("tiny-llama", num_layers=4)
    rt = rewrite(c.tg, policies.parse("every:4"))
    made = Counter(n.meta[CLONE_OF] for n in rt.graph.nodes if CLONE_OF in n.meta)
    marks = {n.name: mark_name(n) for n in c.tg.forward_nodes() if mark_name(n)}
    assert {marks[k]: v for k, v in made.items() if k in marks} == {"l_out.0": 1, "l_out.1": 1, "l_out.2": 1}
    layer = layer_of(c)
    products: dict[str | None, list[int]] = {}  # each layer's matrix products: how many clones each has
    for n in c.tg.forward_nodes():
        if n.target is torch.ops.aten.mm.default:
            products.setdefault(layer[n.name], []).append(made[n.name])
    top = products["l_out.3"]
    assert sum(top) > 0
    for i in range(3):
        assert products[f"l_out.{i}"] == [k + 1 for k in top], (i, products)


def test_every_k_plans_less_as_k_grows(get_case):
    """Keeping every K-th of 16 marks and recomputing the rest as second-level checkpoints: fewer marks live
    through the backward, and still only one layer's intermediates at a time, so the graph shrinks with K
    (up to about sqrt(16)), below on's. A segment's recompute is still the model's own backward, bitwise."""
    c = get_case("tiny-llama", num_layers=16)
    graphs = {name: plan(rewrite(c.tg, policies.parse(name))).graph for name in ("on", "every:2", "every:4")}
    assert graphs["on"] > graphs["every:2"] > graphs["every:4"], graphs
    assert_eager(c, *c.run(rewrite(c.tg, policies.parse("every:4"))))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35"])
def test_a_rewrite_planned_without_its_graph_is_the_graphs_plan_and_the_run(get_case, name):
    """A budget search's probes plan a rewrite without making it (`Rewriter.plan`): the same plan, to the
    byte, as the graph made, and the run holds what was planned; for the built-ins and for save-back sets."""
    c = get_case(name)
    rewriter = Rewriter(c.tg)
    on = policies.parse("on")
    extra = [n for n in saved_nodes(c.tg) if n not in keep_reasons(c.tg, on)]
    assert len(extra) > 20
    partial = [policies.Policy(f"on+{k}", lambda n, s=frozenset(extra[:k]): on.saves(n) or n in s)
               for k in (1, len(extra) // 3, len(extra))]
    for policy in [policies.parse(p) for p in POLICIES] + partial:
        graph = rewriter(policy)
        planned = rewriter.plan(policy)
        assert planned == plan(graph), policy.name
        (loss, *grads), measured = measure(graph, c.args())
        assert (measured.graph, measured.step) == (planned.graph, planned.step), policy.name
        assert_eager(c, loss, grads)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown recompute policy"):
        policies.parse("every:0")


def test_budget_picks_a_plan_that_fits_and_runs_as_planned(get_case):
    c = get_case("tiny-qwen35")
    shape = step.StepShape("window", c.ids.shape[0], c.ids.shape[1], None, 0)
    planner = step.Planner(c.model)
    ladder = planner.plans(shape, step.LADDER)
    low, dots, high = min(p.total for p in ladder.values()), ladder["dots"].total, ladder["off"].total
    budgets = [low + (high - low) * f // 6 for f in range(6)]  # from the smallest plan to just under off
    budgets.append((dots + high) // 2)
    assert sum(dots < b < high for b in budgets) >= 2
    chosen = {}
    for budget in budgets:
        choice = planner.choose(shape, "budget", budget)
        assert choice.plan.total <= budget, (budget, choice.policy)
        chosen[budget] = choice.policy
        graph = planner.build(shape, choice.policy)  # what the trainer runs: the graph planned
        (loss, *grads), measured = measure(graph, c.args())
        assert measured.graph == choice.plan.graph
        assert_eager(c, loss, grads)
        if dots < budget:  # the memory between dots and off is used: some of what only off saves is saved
            assert choice.policy.startswith("dots+") and choice.plan.total > dots, (budget, choice.policy)
    assert len(set(chosen.values())) >= 5, chosen  # the budget changes the answer, between the built-ins too
    between = [chosen[b] for b in sorted(chosen) if dots < b]
    assert len(set(between)) == len(between), between  # and between dots and off


def search(saved: list[int], plan_of, budget: int) -> tuple[int, list[int]]:
    """`step.most_that_fit` on plans `plan_of(k)`: its answer, and the ks it probed."""
    probes: list[int] = []

    def probe(k: int) -> int:
        probes.append(k)
        return plan_of(k)

    return step.most_that_fit(saved, probe, budget, plan_of(0)), probes


def test_budget_search_finds_the_most_that_fit_in_few_probes():
    """The search against every k: the largest whose plan fits, on plans that grow with k in steps and
    plateaus; a handful of probes where plans grow linearly with the bytes saved back, and never far more
    than a bisection's."""
    rng = random.Random(0)
    for _ in range(500):
        n = rng.choice([1, 2, 5, 40, 180, 767])
        sizes = [rng.choice([0, 1, 5, 100, 1000]) for _ in range(n)]
        grows = [int(b * rng.choice([0, 0.5, 1, 3])) for b in sizes]  # a value saved back adds none, some, more
        saved, totals = list(itertools.accumulate(sizes, initial=0)), list(itertools.accumulate(grows, initial=1000))
        budget = rng.randint(1000, totals[-1] + 10)
        k, probes = search(saved, totals.__getitem__, budget)
        assert k == max(i for i in range(n + 1) if totals[i] <= budget)
        assert len(probes) <= 2 * math.ceil(math.log2(n + 1)) + 2 and all(0 < p <= n for p in probes)
    saved = [100 * k for k in range(768)]  # linear: 0.87 of a byte per byte saved back
    for budget in (1000, 1050, 20_000, 40_000, 66_000, 67_000):
        k, probes = search(saved, lambda k: 1000 + 87 * k, budget)
        assert k == min(767, (budget - 1000) // 87) and len(probes) <= 4, (budget, probes)


def test_budget_below_the_smallest_plan_is_refused_with_it(get_case):
    c = get_case("tiny-llama")
    shape = step.StepShape("window", c.ids.shape[0], c.ids.shape[1], None, 0)
    planner = step.Planner(c.model)
    ladder = planner.plans(shape, step.LADDER)
    smallest = min(ladder, key=lambda k: ladder[k].total)  # the first of the smallest, in the ladder's order
    total = ladder[smallest].total
    with pytest.raises(GateRefused, match=f"smallest plan remat can make is {smallest} at {mib(total)}"):
        planner.choose(shape, "budget", total - 1)
    choice = planner.choose(shape, "auto", total)  # it fits, with what saving back leaves free
    assert choice.policy.split("+")[0] == smallest and choice.plan.total == total, choice.policy


def test_cli_plan_budget_below_the_smallest_plan_exits_3_naming_it(tmp_path):
    """`remat plan --recompute budget`, the real command: below the smallest plan it is refused (exit 3) with
    that plan named; with a budget that fits, --json carries the policy the gate chose."""
    # the optimizer after the backward: with auto, a budget under these plans would put it inside instead
    s = TrainSettings(model="tiny-llama", ctx=64, lora=False, optimizer_in_backward="off")
    ladder = plan_settings(s, step.LADDER)  # what `remat plan` plans: the model's config alone
    smallest = min(ladder, key=lambda k: ladder[k].total)
    low, dots, off = ladder[smallest].total, ladder["dots"].total, ladder["off"].total
    env = {k: v for k, v in os.environ.items() if k != "REMAT_DEBUG"} | {
        "REMAT_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}

    def remat_plan(budget: int, *extra: str) -> subprocess.CompletedProcess:
        args = ["plan", "--model", "tiny-llama", "--ctx", "64", "--recompute", "budget", "--full",
                "--memory-budget", f"{budget}B", "--dtype", "float32", "--optimizer-in-backward", "off", *extra]
        return subprocess.run([sys.executable, "-m", "remat", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=600, check=False)

    r = remat_plan(low - 1)
    assert r.returncode == 3, r
    assert r.stdout == "" and "Traceback" not in r.stderr, r
    assert r.stderr.startswith("remat: error: refused"), r
    assert f"the smallest plan remat can make is {smallest} at {mib(low)}" in r.stderr, r

    budget = (dots + off) // 2
    r = remat_plan(budget, "--json")
    assert r.returncode == 0, r
    result = json.loads(r.stdout)
    expected = planner_of(s).choose(step.StepShape.of(s), "budget", budget)
    assert result["policy"] == expected.policy and result["policy"].startswith("dots+"), result["policy"]
    assert result["plan"]["total"] == expected.plan.total <= budget
