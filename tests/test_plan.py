"""remat.core.plan: the planner's bytes, by hand, against a measured run, and per category."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from planning import live_at_peak
from remat.core.graph import TrainGraph
from remat.core.plan import measure, plan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("recompute", ["off", "on"])
def test_planner_agrees_with_measurement(case, recompute):
    tg = case.rt if recompute == "on" else case.tg
    planned = plan(tg).graph
    outputs, measured = measure(tg, case.args())
    assert measured.cuda_max_allocated is None  # CPU
    assert abs(planned - measured.graph) <= 0.05 * measured.graph, (planned, measured.graph)
    # the step's peak with its grads, from the same run's real storages: the total's figure for the step
    step = plan(tg).step
    assert step == measured.step, (step, measured.step)
    assert measured.step >= measured.graph
    loss, grads = case.run(tg)
    assert torch.equal(outputs[0], loss) and all(torch.equal(a, b) for a, b in zip(outputs[1:], grads))


def test_recompute_shrinks_the_graph(case):
    off, on = plan(case.tg), plan(case.rt)
    assert on.graph < off.graph
    assert {k: v for k, v in on.as_dict().items() if k not in ("graph", "step", "total")} == {
        k: v for k, v in off.as_dict().items() if k not in ("graph", "step", "total")
    }


# Hand-counted peaks (float32); placeholders and outputs are not graph memory.
def views_and_in_place(x):  # x: 1024 float32 = 4096 bytes, an input: never counted
    a = x * 2  # A: 4096 bytes                                 live 4096
    v = a[:512]  # a view of A; `a` itself is never used again
    v.mul_(3)  # in place, through the view: no allocation
    b = x.repeat(4)  # B: 16384                                 live 20480
    t = v * 2  # T: 2048                                        live 22528  <- the peak
    #            v's last use: A is freed here, through its last alias  -> 18432
    s = t.sum()  # S: 4                                         live 18436, T freed -> 16388
    e = b[:1024] * s  # E: 4096                                 live 20484, B and S freed -> 4096
    return (e.sum(),)  # an output: never counted; E freed -> 0


# A freed at its last direct use (the view) would give 20484; A never freed, 24580.


def base_outlives_its_view(x):  # x: 1024 float32, an input
    a = x * 2  # A: 4096                                       live 4096
    v = a[:256]  # a view of A: the last alias made, dead after the next node
    s = v.sum()  # S: 4                                        live 4100
    b = a * s  # B: 4096                                       live 8196  <- the peak; A, S freed
    return (b.sum(),)  # an output; B freed


# A freed with its last-made alias (the view) would give 4100.


@pytest.mark.parametrize(("fn", "peak"), [(views_and_in_place, 22528), (base_outlives_its_view, 8196)])
def test_graph_peak_by_hand(fn, peak):
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(1024))
    nodes = list(gm.graph.nodes)
    assert any(n.target is torch.ops.aten.slice.Tensor for n in nodes)
    tg = TrainGraph(gm, ["input"], ["x"], boundary=nodes[-2])
    assert live_at_peak(tg)[0] == peak
    assert plan(tg).graph == peak  # the plan's one-pass peaks (`_peaks`), not `live_at_peak`'s sweep
    outputs, measured = measure(tg, [torch.randn(1024)])
    assert measured.graph == peak
    assert len(outputs) == 1


def test_recompute_graph_grows_one_hidden_state_per_layer(get_case):
    shallow, deep = get_case("tiny-llama"), get_case("tiny-llama", 6)
    hidden = shallow.model.config.hidden_size
    batch, ctx = shallow.ids.shape
    assert (shallow.model.config.num_hidden_layers, deep.model.config.num_hidden_layers) == (2, 6)
    grown = plan(deep.rt).graph - plan(shallow.rt).graph
    assert grown == 4 * batch * ctx * hidden * 4  # one float32 l_out per layer
    # without recompute each layer costs far more than its checkpoint
    assert plan(deep.tg).graph - plan(shallow.tg).graph > 4 * grown


def _check_categories(p, trainable, frozen_bytes):
    param_bytes = sum(t.numel() * t.element_size() for t in trainable)
    assert p.params == p.grads == param_bytes > 0
    assert p.optimizer == 2 * 4 * sum(t.numel() for t in trainable)
    assert p.frozen == frozen_bytes
    assert p.workspace == 3 * max(t.numel() * t.element_size() for t in trainable)
    assert p.graph <= p.step <= p.graph + p.grads  # the grads are made during the step, not all at its start
    d = p.as_dict()
    resident = sum(d[k] for k in ("params", "frozen", "optimizer", "cache", "trace", "runtime"))
    assert d["total"] == p.total == resident + max(p.step, p.grads + p.workspace)
    assert set(d) == {"params", "frozen", "grads", "optimizer", "graph", "step", "cache", "workspace", "trace",
                      "runtime", "total"}
    assert p.runtime == p.trace == 0  # a graph's plan; the trainer adds the process's own


def test_categories(case):
    trainable = list(case.trainable().values())
    buffers = sum(b.numel() * b.element_size() for b in case.model.buffers())
    for tg in (case.tg, case.rt):
        _check_categories(plan(tg), trainable, buffers)
    assert plan(case.tg).cache == 0  # the one-ubatch step has no state inputs (walk caches)


def test_categories_with_frozen_params(make_case):
    def freeze(model):
        model.model.embed_tokens.weight.requires_grad_(False)

    c = make_case("tiny-llama", prepare=freeze)
    trainable = list(c.trainable().values())
    frozen = c.model.model.embed_tokens.weight
    buffers = sum(b.numel() * b.element_size() for b in c.model.buffers())
    _check_categories(plan(c.tg), trainable, frozen.numel() * frozen.element_size() + buffers)


def test_cache_category_is_the_state_inputs():
    def step(w, state, x):
        return ((x @ w).sum() + state.sum(),)

    gm = make_fx(step, tracing_mode="fake")(torch.randn(4, 4), torch.zeros(3, 5), torch.randn(2, 4))
    tg = TrainGraph(gm, ["trainable", "state", "input"], ["w", "state", "x"], boundary=list(gm.graph.nodes)[-2])
    p = plan(tg)
    assert (p.params, p.grads, p.optimizer, p.frozen, p.cache) == (64, 64, 128, 0, 60)
    assert p.step == p.graph + 64  # this toy step makes no grad: w's counts as held throughout
    # the cache is held with the step and given back before the optimizer's update (grads + workspace)
    assert p.total == 64 + 128 + max(p.step + 60, 64 + 3 * 64)
