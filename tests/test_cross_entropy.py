"""The loss's cross-entropy (`remat.core.cross_entropy`): the values of `F.cross_entropy` on float32 logits, bit
for bit, and one logits-sized tensor fewer at the loss head's peak, measured by running the step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat.core.cross_entropy import cross_entropy
from remat.core.graph import StepInputs
from remat.core.plan import measure, plan
from remat.models.load import build_from_config, load_config
from remat.models.steps import window_step

pytestmark = pytest.mark.usefixtures("one_thread")
aten = torch.ops.aten


def logits_and_targets(dtype: torch.dtype, vocab: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(48, vocab, generator=g) * scale).to(dtype)
    x[0, 3], x[1, :] = float("inf"), float("-inf")  # a row with +inf (its values NaN), a row all -inf
    x[2, 5] = float("nan")
    x[3, :] = torch.finfo(dtype).max  # the largest value, everywhere in a row
    target = torch.randint(0, vocab, (48,), generator=g)
    target[[4, 9, 10]] = -100
    return x, target


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (NaN equal to itself where the bits are equal)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab", [17, 1003, 49152])  # odd, and a multiple of every vector width
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("save_log_probs", [False, True], ids=["logits saved", "log-probs saved"])
def test_equals_torch_cross_entropy_bit_for_bit(dtype, vocab, reduction, save_log_probs):
    """Loss and the logits' gradient as autograd's F.cross_entropy on the logits in float32 (float64 as they
    are), for every scale of logits, inf and NaN among them, ignored targets, any upstream gradient; the backward
    from the saved logits (made again) or from the saved log-probabilities alike."""
    wide = torch.promote_types(dtype, torch.float32)
    for seed, scale in enumerate((1e-3, 1.0, 30.0)):
        x, target = logits_and_targets(dtype, vocab, scale, seed)
        grad = torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=wide) * 3
        a = x.clone().requires_grad_()
        expected = F.cross_entropy(a.to(wide), target, ignore_index=-100, reduction=reduction)
        (expected_grad,) = torch.autograd.grad(expected, a, grad)
        b = x.clone().requires_grad_()
        loss = cross_entropy(b, target, reduction, save_log_probs)
        (got_grad,) = torch.autograd.grad(loss, b, grad)
        assert torch.equal(bits(loss), bits(expected)), (loss, expected)
        assert got_grad.dtype == expected_grad.dtype == dtype
        assert torch.equal(bits(got_grad), bits(expected_grad))
        assert torch.equal(bits(x), bits(b.detach()))  # the logits given are not written


def test_all_targets_ignored_is_nan_as_torch():
    x = torch.randn(4, 11, requires_grad=True)
    target = torch.full((4,), -100)
    assert cross_entropy(x, target).isnan() and F.cross_entropy(x, target).isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_holds_one_logits_tensor_fewer(dtype):
    """A real step (tiny-llama with a 32,000-token vocabulary: the loss head is its peak), run and measured
    (`plan.measure`: every tensor the graph makes, as it is made and freed): its peak is its plan, and with the
    kernels' results written out of place instead (the same ops, as autograd's cross-entropy runs them) it holds
    at least one logits-sized tensor more, for the same loss and grads bit for bit."""
    config = load_config("tiny-llama")
    config.vocab_size = 32_000
    model = build_from_config(config, seed=0)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 32_000, (1, 96), generator=g) for _ in range(2))
    tg = window_step(model, ids, labels, dtype=dtype)
    args = StepInputs.of(model).args(ids, labels)
    with torch.no_grad():
        in_place_out, in_place = measure(tg, args)
    assert in_place.graph == plan(tg).graph
    written_over = 0
    for n in tg.graph.nodes:
        if n.target in (aten._log_softmax_backward_data.out, aten._log_softmax.out):
            n.target = {aten._log_softmax.out: aten._log_softmax.default}.get(
                n.target, aten._log_softmax_backward_data.default)
            n.kwargs = {}
            written_over += 1
    # bfloat16: the log-softmax over the float32 copy too, once: a loss in one piece keeps its log-probabilities
    assert written_over == (1 if dtype == torch.float32 else 2)
    tg.gm.recompile()
    with torch.no_grad():
        out_of_place_out, out_of_place = measure(tg, args)
    assert all(torch.equal(a, b) for a, b in zip(in_place_out, out_of_place_out, strict=True))
    logits = 96 * 32_000 * 4
    # less a few bytes: scalars freed at other points of the two orders (measured: 8)
    assert out_of_place.graph - in_place.graph >= logits - 64, (in_place.graph, out_of_place.graph)
