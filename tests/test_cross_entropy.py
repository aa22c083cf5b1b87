"""The loss's cross-entropy (`remat.core.cross_entropy`): the values of `F.cross_entropy` on float32 logits, bit
for bit, and fewer logits-sized tensors at the loss head's peak than autograd's, measured by running the step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat.core.cross_entropy import cross_entropy
from remat.core.graph import StepInputs
from remat.core.plan import measure, plan
from remat.models import hf
from remat.models.load import build_from_config, load_config
from remat.models.steps import window_step

pytestmark = pytest.mark.usefixtures("one_thread")


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
def test_equals_torch_cross_entropy_bit_for_bit(dtype, vocab, reduction):
    """Loss and the logits' gradient as autograd's F.cross_entropy on the logits in float32 (float64 as they
    are), for every scale of logits, inf and NaN among them, ignored targets, any upstream gradient."""
    wide = torch.promote_types(dtype, torch.float32)
    for seed, scale in enumerate((1e-3, 1.0, 30.0)):
        x, target = logits_and_targets(dtype, vocab, scale, seed)
        grad = torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=wide) * 3
        a = x.clone().requires_grad_()
        expected = F.cross_entropy(a.to(wide), target, ignore_index=-100, reduction=reduction)
        (expected_grad,) = torch.autograd.grad(expected, a, grad)
        b = x.clone().requires_grad_()
        loss = cross_entropy(b, target, reduction)
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
def test_the_step_holds_fewer_logits_sized_tensors_than_autograds(dtype, monkeypatch):
    """A real step (tiny-llama with a 32,000-token vocabulary: the loss head is its peak), run and measured
    (`plan.measure`: every tensor the graph makes, as it is made and freed): its peak is its plan, and the same step
    with autograd's cross-entropy (transformers' loss: `F.cross_entropy` on the float32 logits) holds more, for the
    same loss and grads bit for bit. In logits-sized float32 tensors: autograd's peaks at three in the backward (the
    log-probabilities, their gradient, the logits'); here at two in float32 (the logits and their log-probabilities;
    the log-probabilities and the nll gradient, written over), at one and a half in bfloat16 (the half-precision
    logits and their float32 copy, log-softmaxed over; in the backward that copy again and a quarter of the nll
    gradient, then the gradient's cast)."""
    config = load_config("tiny-llama")
    config.vocab_size = 32_000
    model = build_from_config(config, seed=0)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 32_000, (1, 96), generator=g) for _ in range(2))
    args = StepInputs.of(model).args(ids, labels)
    tg = window_step(model, ids, labels, dtype=dtype)
    with torch.no_grad():
        ours_out, ours = measure(tg, args)
    assert ours.graph == plan(tg).graph
    monkeypatch.setattr(hf, "cross_entropy", lambda logits, target, reduction: F.cross_entropy(
        logits.float(), target, ignore_index=-100, reduction=reduction))
    tg = window_step(model, ids, labels, dtype=dtype)
    with torch.no_grad():
        autograds_out, autograds = measure(tg, args)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ours_out, autograds_out, strict=True))
    logits = 96 * 32_000 * 4
    # less a few bytes: scalars freed at other points of the two orders
    fewer = 1 if dtype == torch.float32 else 1.5
    assert autograds.graph - ours.graph >= fewer * logits - 64, (ours.graph, autograds.graph)
