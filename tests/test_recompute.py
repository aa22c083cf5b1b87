"""remat.core.recompute: the rewrite keeps what it must, recomputes the rest, and changes no bit of the step."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

import remat.core.recompute as rr
from remat.core.graph import TrainGraph
from remat.core.marks import MARK_OP, mark_name
from remat.core.recompute import CLONE_OF, explain, keep_reasons, rewrite, saved_nodes, verify

aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_same_step(a, b) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
    assert len(grads_a) == len(grads_b)
    for i, (x, y) in enumerate(zip(grads_a, grads_b)):
        assert torch.equal(x, y), f"grad {i}: max abs diff {(x - y).abs().max().item()}"


def differs(a, b) -> bool:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return not torch.equal(loss_a, loss_b) or any(not torch.equal(x, y) for x, y in zip(grads_a, grads_b))


def clones_of(tg: TrainGraph) -> dict[str, fx.Node]:
    """Original name -> its clone in a rewritten graph."""
    return {n.meta[CLONE_OF]: n for n in tg.graph.nodes if CLONE_OF in n.meta}


def without(*reasons: str):
    """keep_reasons with some rules switched off, to show the rules matter."""
    original = rr.keep_reasons

    def patched(tg, policy=rr.LAYER):
        return {n: r for n, r in original(tg, policy).items() if r not in reasons}

    return patched


# ------------------------------------------------------------------------------------- the presets


def test_recompute_on_equals_off_bitwise(case):
    assert len(clones_of(case.rt)) > 0
    assert_same_step(case.run(case.tg), case.run(case.rt))


def _adamw(tg: TrainGraph, args: list[torch.Tensor], n_train: int, steps: int = 3):
    params = [torch.nn.Parameter(a.detach().clone()) for a in args[:n_train]]
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            loss, grads = tg(*params, *args[n_train:])
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, params


def test_recompute_on_equals_off_over_adamw_steps(case):
    n = len(case.trainable())
    losses_off, params_off = _adamw(case.tg, case.args(), n)
    losses_on, params_on = _adamw(case.rt, case.args(), n)
    assert not torch.equal(losses_off[0], losses_off[-1])  # the steps did train
    for a, b in zip(losses_off, losses_on):
        assert torch.equal(a, b)
    for name, a, b in zip(case.trainable(), params_off, params_on):
        assert torch.equal(a, b), name


def _lm_head_first(model) -> None:
    # lm_head registered before the decoder: a different parameter order than the preset's
    model._modules["model"] = model._modules.pop("model")


def test_grads_follow_reordered_parameters(make_case):
    c = make_case("tiny-llama", prepare=_lm_head_first)
    names = list(c.trainable())
    assert names[0] == "lm_head.weight" and c.tg.names[: len(names)] == names
    eager_loss, eager_grads = c.eager
    by_name = dict(zip(names, eager_grads))
    for tg in (c.tg, c.rt):
        loss, grads = c.run(tg)
        assert torch.equal(loss, eager_loss)
        assert [g.shape for g in grads] == [by_name[n].shape for n in names]
        for name, g in zip(names, grads):
            assert torch.equal(g, by_name[name]), name


# -------------------------------------------------------------------- mutation rule, hand-built


def trace_step(loss_fn, args: list[torch.Tensor], n_train: int) -> TrainGraph:
    """A TrainGraph of loss_fn's train step, the way capture builds one: loss, then grads of the
    first n_train args; the boundary is the last node traced before the backward starts."""
    boundary = []

    def step(*a):
        loss = loss_fn(*a)
        boundary.append(list(get_proxy_mode().tracer.graph.nodes)[-1])
        return (loss, *torch.autograd.grad(loss, a[:n_train]))

    with torch.enable_grad():
        gm = make_fx(step, tracing_mode="fake")(*args)
    roles = ["trainable"] * n_train + ["buffer"] * (len(args) - n_train - 1) + ["input"]
    return TrainGraph(gm, roles, [f"arg{i}" for i in range(len(args))], boundary[0])


def mutating_loss(w1, w2, state, x):
    h = torch.tanh(x @ w1)
    before = state[0] * 3  # reads the buffer through a view, before the write below
    h = h * before  # the backward needs `before`
    state[0].add_(1)  # a later in-place write, through another view
    after = state[0] * 5  # reads the buffer after its only write
    h = torch.tanh(h * after)  # the backward needs `after`
    return (h @ w2).pow(2).mean()


@pytest.fixture
def mutating():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(8, 8, generator=g, requires_grad=True)
    w2 = torch.randn(8, 4, generator=g, requires_grad=True)
    state = torch.linspace(0.5, 1.5, 16).reshape(2, 8)
    x = torch.randn(3, 8, generator=g)

    def args():  # the step writes its buffer: each run gets a fresh one
        return [w1, w2, state.clone(), x]

    tg = trace_step(mutating_loss, args(), 2)
    # find the two reads and the write by structure, not by name
    state_node = tg.placeholders()[2]
    muls = [n for n in tg.forward_nodes() if n.target is aten.mul.Tensor and n.args[1] in (3, 5)]
    before, after = sorted(muls, key=lambda n: n.args[1])
    (write,) = [n for n in tg.forward_nodes() if n.target is aten.add_.Tensor]
    for n in (before, after, write):
        assert n.args[0].target is aten.select.int and n.args[0].args[0] is state_node
    return tg, args, before, after, write


def _run(tg, args):
    with torch.no_grad():
        return tg(*args)


def test_read_before_a_later_write_is_kept(mutating):
    tg, _, before, after, write = mutating
    pos = {n: i for i, n in enumerate(tg.graph.nodes)}
    assert pos[before] < pos[write] < pos[after]
    saved = saved_nodes(tg)
    assert before in saved and after in saved
    reasons = keep_reasons(tg)
    assert reasons.get(before) == "reads-mutated-root"
    assert reasons.get(before.args[0]) == "reads-mutated-root"  # the view it reads through
    assert reasons.get(write) == "in-place"
    # a read after the only write is no reason to keep: it is recomputed
    assert after not in reasons
    clones = clones_of(rewrite(tg))
    assert after.name in clones and before.name not in clones and write.name not in clones


def test_mutation_rule_keeps_recompute_bitwise(mutating, monkeypatch):
    tg, args, *_ = mutating
    off = _run(tg, a := args())
    written_off = a[2]
    on = _run(rewrite(tg), a := args())
    assert_same_step(off, on)
    assert torch.equal(written_off, a[2])  # the in-place write ran exactly once in both
    w1, w2, state, x = args()
    eager_loss = mutating_loss(w1, w2, state, x)
    assert_same_step(off, (eager_loss.detach(), list(torch.autograd.grad(eager_loss, [w1, w2]))))
    # without the rule, `before` is recomputed in backward from the advanced buffer
    monkeypatch.setattr(rr, "keep_reasons", without("reads-mutated-root"))
    assert differs(off, _run(rewrite(tg), args()))


# ---------------------------------------------------------------------------------------- random ops


def dropout_loss(w1, w2, x):
    h = torch.tanh(x @ w1)
    out, _ = aten.native_dropout(h, 0.5, True)
    return (torch.tanh(out) @ w2).pow(2).mean()


def _seeded(tg, args, seed=0):
    torch.manual_seed(seed)
    return _run(tg, args)


def test_random_op_is_kept_hand_built(monkeypatch):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 8, generator=g, requires_grad=True), torch.randn(8, 4, generator=g, requires_grad=True),
            torch.randn(3, 8, generator=g)]
    tg = trace_step(dropout_loss, args, 2)
    (drop,) = [n for n in tg.graph.nodes if n.target is aten.native_dropout.default]
    assert keep_reasons(tg)[drop] == "random"
    rt = rewrite(tg)
    assert drop.name not in clones_of(rt)
    off = _seeded(tg, args)
    assert_same_step(off, _seeded(rt, args))
    assert differs(off, _seeded(tg, args, seed=1))  # dropout does draw
    monkeypatch.setattr(rr, "keep_reasons", without("random"))
    assert differs(off, _seeded(rewrite(tg), args))  # a recomputed dropout draws anew


def test_attention_dropout_is_kept(make_case):
    def dropout(model):
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1

    c = make_case("tiny-llama", prepare=dropout)
    reasons = keep_reasons(c.tg)
    random = [n for n, r in reasons.items() if r == "random"]
    assert len(random) == c.model.config.num_hidden_layers
    off = _seeded(c.tg, c.args())
    assert_same_step(off, _seeded(c.rt, c.args()))
    assert differs(off, _seeded(c.tg, c.args(), seed=1))
    assert not set(clones_of(c.rt)) & {n.name for n in random}


# -------------------------------------------------------------------------------------------- verify


def test_verify_finds_every_clone_equal(case):
    result = verify(case.rt, case.args())
    # one clone per node and region that needs it
    assert result.clones == sum(CLONE_OF in n.meta for n in case.rt.graph.nodes) > 0
    assert result.equal and result.first_difference is None


def test_verify_names_a_planted_wrong_clone(get_case):
    c = get_case("tiny-llama")
    # each forward node's layer: the first mark at or after it, in forward order
    forward = c.tg.forward_nodes()
    layer = {n.name: next((mark_name(m) for m in forward[i:] if mark_name(m)), None) for i, n in enumerate(forward)}
    rt = rewrite(c.tg)  # a copy of our own to break
    graph = rt.graph
    clone = next(n for n in graph.nodes
                 if n.target is aten.add.Tensor and layer.get(n.meta.get(CLONE_OF)) == "l_out.0")
    # the clone now computes its op, then adds 1e-3: same name, op and shape, a wrong value
    with graph.inserting_before(clone):
        right = graph.call_function(clone.target, clone.args, clone.kwargs)
    clone.args, clone.kwargs = (right, 1e-3), {}
    rt.gm.recompile()

    diff = verify(rt, c.args()).first_difference
    assert diff is not None
    assert diff.node == clone.name
    assert diff.op == str(aten.add.Tensor)
    assert diff.mark == "l_out.0"
    assert diff.shape == list(clone.meta["val"].shape)
    assert diff.max_abs_diff == pytest.approx(1e-3, rel=1e-2)


# ----------------------------------------------------------------------------------------- structure


def _saved_ops(tg: TrainGraph) -> Counter:
    return Counter(str(n.target) for n in saved_nodes(tg) if n.op != "placeholder")


def test_each_layer_adds_one_mark_to_the_saved_set(get_case):
    shallow, deep = get_case("tiny-llama"), get_case("tiny-llama", 6)
    assert (shallow.model.config.num_hidden_layers, deep.model.config.num_hidden_layers) == (2, 6)
    grown = _saved_ops(deep.rt)
    grown.subtract(_saved_ops(shallow.rt))
    assert +grown == Counter({str(MARK_OP): 4}) and not -grown
    # without recompute the saved set grows by whole layers of intermediates
    off = _saved_ops(deep.tg)
    off.subtract(_saved_ops(shallow.tg))
    assert sum(off.values()) > 4 * 10


def test_saved_nodes_of_the_rewrite_are_kept(case):
    reasons = keep_reasons(case.rt)
    for n in saved_nodes(case.rt):
        assert n.op == "placeholder" or n.target is MARK_OP or n in reasons, n.format_node()
    assert all(CLONE_OF not in n.meta for n in case.rt.forward_nodes())
    # the original graph saves plenty that is not kept: this check has something to catch
    assert any(n not in keep_reasons(case.tg) for n in saved_nodes(case.tg))


def test_explain_accounts_for_every_saved_node(case):
    e = explain(case.tg)
    assert len(e.kept) + sum(e.recomputed.values()) == len(saved_nodes(case.tg))
    assert sum(e.recomputed.values()) <= len(clones_of(case.rt))
    assert e.counts["layer"][str(MARK_OP)] == case.model.config.num_hidden_layers
    assert "recomputed" in e.format()
