"""The gated delta rule as two ops (`remat.models.delta_rule`): the model's own values and gradients, bitwise; a
traced step that does not grow with the window; and a planned workspace that is what the op allocates."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from remat.bench.common import peak_during
from remat.core.graph import StepInputs
from remat.core.plan import value_bytes
from remat.models import delta_rule
from remat.models.hf import causal_lm_loss
from remat.models.load import load_model
from remat.models.steps import window_step

pytestmark = pytest.mark.usefixtures("one_thread")

MODULE = modeling_qwen3_5.__name__
RULE = modeling_qwen3_5.torch_chunk_gated_delta_rule  # the model's own


def _inputs(tokens: int, heads: int = 4, dim: int = 32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, tokens, heads, dim, generator=g) for _ in range(3))
    decay = -torch.rand(1, tokens, heads, generator=g)
    beta = torch.rand(1, tokens, heads, generator=g)
    state = torch.randn(1, heads, dim, dim, generator=g)
    return [t.requires_grad_() for t in (q, k, v, decay, beta, state)]


def _loss_and_grads(rule, xs: list[torch.Tensor], seed: int = 1):
    q, k, v, decay, beta, state = xs
    out, last = rule(q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + (last * torch.randn(last.shape, generator=g)).sum()
    return [out.detach(), last.detach(), *torch.autograd.grad(loss, xs)]


@pytest.mark.parametrize("tokens", [64, 300])  # one chunk; five with padding
def test_the_ops_are_the_models_rule_bitwise(tokens):
    """Values and every input's gradient (the start state's too) equal the model's own function under
    autograd, bit for bit: the backward runs the same function on the same values. The layouts are eager's
    too (they differ between these two lengths), since what the model does next rounds by layout."""
    xs = _inputs(tokens)
    want = _loss_and_grads(RULE, xs)
    got = _loss_and_grads(lambda *a, **k: delta_rule._traced_rule(*a, module=MODULE, own=RULE, **k), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [_order(a) for a in got] == [_order(b) for b in want]
    assert not all(a.is_contiguous() for a in got)  # so the orders could differ


def _order(t: torch.Tensor) -> list[int]:
    return sorted(range(t.dim()), key=lambda i: -t.stride(i))


@pytest.mark.parametrize("ctx", [64, 100])  # one chunk; two with padding
def test_a_traced_step_is_the_models_own_backward_bitwise(ctx):
    """The step traced with the ops against transformers' eager forward and backward of the whole model
    (its chunk loop, unswapped): loss and every gradient bit for bit."""
    lm = load_model("tiny-qwen35", seed=0)
    g = torch.Generator().manual_seed(ctx)
    ids, labels = (torch.randint(0, lm.model.config.vocab_size, (2, ctx), generator=g) for _ in range(2))
    tg = window_step(lm.model, ids, labels)
    inputs = StepInputs.of(lm.model)
    with torch.no_grad():
        loss, grads = tg(*inputs.args(ids, labels))
    eager_loss = causal_lm_loss(lm.model, ids, labels)
    eager_grads = torch.autograd.grad(eager_loss, list(inputs.trainable.values()))
    assert torch.equal(loss, eager_loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))


def _ops(ctx: int) -> tuple[int, collections.Counter]:
    lm = load_model("tiny-qwen35", seed=0)
    ids = torch.zeros(1, ctx, dtype=torch.long)
    tg = window_step(lm.model, ids, ids.clone())
    return len(tg.graph.nodes), collections.Counter(n.target for n in tg.graph.nodes)


def test_the_traced_step_does_not_grow_with_the_window():
    """Without the ops the chunk loop unrolled: tiny-qwen35's step grew by its linear layers' loop bodies
    with every 64 tokens. With them, one forward and one backward node per linear-attention layer."""
    lm = load_model("tiny-qwen35", seed=0)
    linear = sum(t == "linear_attention" for t in lm.model.config.layer_types)
    short, ops_short = _ops(128)  # from 2 chunks on: with one the output comes back contiguous
    long, ops_long = _ops(640)
    assert short == long
    assert ops_short[delta_rule.FORWARD] == ops_short[delta_rule.BACKWARD] == linear > 0
    assert ops_short == ops_long


def _specs(xs: list[torch.Tensor], grad_state: bool) -> tuple:
    spec = [(tuple(t.shape), t.dtype) for t in xs]
    return (spec[2], spec[5] if grad_state else None, *spec)  # grad_out is shaped as value


@pytest.mark.parametrize("tokens", [900, 896])  # 15 chunks with padding, 14 without: both extrapolated
def test_the_planned_workspace_is_what_the_op_allocates(tokens):
    """The backward's internal peak as planned (fake tensors at 3-5 chunks, extrapolated) against the
    profiler's allocation events of the real op at full size: an oracle that is not the op's own tracker.
    The plan may only over-count, by at most 7%: the weak references its tracker holds keep autograd from
    accumulating some gradients in place (the same run, tracked, allocates exactly the plan; 5.5-6% more
    at 700-2,048 tokens here)."""
    assert -(-tokens // 64) > 12  # past what `_peak_at` runs at full size
    xs = [t.detach() for t in _inputs(tokens)]
    grad_out, grad_state = torch.randn_like(xs[2]), torch.randn_like(xs[5])
    args = (grad_out, grad_state, *xs)

    def run():
        return delta_rule.gated_delta_rule_backward(*args, MODULE, 64, True)

    grads, real = peak_during(run, torch.device("cpu"))
    planned = delta_rule._peak_at(False, _specs(xs, True), tokens, MODULE, 64, True)
    direct = delta_rule._peak(False, _specs(xs, True), module=MODULE, chunk_size=64, l2norm=True)  # at full size
    assert planned == direct  # the extrapolation is the plan at full size, to the byte
    assert planned >= value_bytes(grads)
    assert real <= planned <= 1.07 * real, (real, planned)


def test_the_rules_chunk_is_the_one_the_traced_step_cuts_by():
    """`chunk_sizes` (where a window's plan jumps, for `remat plan --ctx max`'s search) reads the model's function's
    default; the oracle is the chunk the layers hand the op in a traced step. A model without the rule has none."""
    lm = load_model("tiny-qwen35", seed=0)
    ids = torch.zeros(1, 100, dtype=torch.long)
    tg = window_step(lm.model, ids, ids.clone())
    handed = {n.args[7] for n in tg.graph.nodes if n.target is delta_rule.FORWARD}
    assert handed and delta_rule.chunk_sizes(lm.model) == handed
    assert delta_rule.chunk_sizes(load_model("tiny-llama", seed=0).model) == set()
