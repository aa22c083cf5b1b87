"""Cross-entropy in float32 (as transformers' loss), bit for bit as `F.cross_entropy(logits.float(), ...)`, holding
fewer logits-sized tensors at once.

The loss head is where a step peaks (SmolLM2 at 256 tokens a piece: float32 logits of 48 MiB). Autograd's
cross-entropy holds three of them in the backward: the saved log-probabilities, their gradient
(nll_loss_backward: zeros but one value a row) and the logits' gradient (`_log_softmax_backward_data`). Here the
same aten kernels run, each writing over an input nothing else reads. Float32 logits: their log-probabilities are
saved, and the logits' gradient written over the nll gradient (a row of it is summed before any of it is written):
two. Half-precision logits: saved as they are (half the bytes of their log-probabilities: a loss in many pieces
keeps every piece's until the backward reaches it); the backward casts them and log-softmaxes over the float32
copy (a row's maximum and sum are taken before any of it is written), makes the nll gradient a quarter of the rows
at a time (`BLOCKS`) in one reused tensor and writes the logits' gradient over those rows of the log-probabilities
(a row is read where it is written, after its gradient's sum): one and a quarter, then the half-precision cast.
The forward's log-probabilities are never written over: a rewrite keeps whatever reads a value written later (the
loss head of every piece, held to the backward). The values are the kernels' own.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
IGNORE_INDEX = -100
# Half-precision logits: the nll gradient is made in this many blocks of rows, a quarter of a logits-sized tensor at a
# time, for 7 nodes a block in the traced step (its slices and two kernels; a loss in 128 pieces: 512 blocks)
BLOCKS = 4
_REDUCTIONS = {"mean": 1, "sum": 2}


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
        logp = _log_softmax(logits)
        loss, _ = aten.nll_loss_forward(logp, target, None, _REDUCTIONS[reduction], IGNORE_INDEX)
        # cast logits: the backward casts them again (their bytes are half the log-probabilities')
        ctx.save_for_backward(logp if logp.dtype == logits.dtype else logits, target)
        ctx.reduction = _REDUCTIONS[reduction]
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        saved, target = ctx.saved_tensors
        # the targets counted (nll_loss_forward's total weight, without weights): not saved from the forward, whose
        # node a rewrite would make again in the backward, holding the log-probabilities it reads until then
        total_weight = (target != IGNORE_INDEX).sum().to(grad.dtype)
        if saved.dtype == grad.dtype:  # the forward's log-probabilities
            d = aten.nll_loss_backward(grad, saved, target, None, ctx.reduction, IGNORE_INDEX, total_weight)
            return aten._log_softmax_backward_data.out(d, saved, 1, saved.dtype, out=d), None, None
        logp = _log_softmax(saved)
        return _over_log_probs(grad, logp, target, ctx.reduction, total_weight).to(saved.dtype), None, None


def _over_log_probs(grad: torch.Tensor, logp: torch.Tensor, target: torch.Tensor, reduction: int,
                    total_weight: torch.Tensor) -> torch.Tensor:
    """The logits' gradient written over `logp` (made in the backward), the nll gradient a block of rows at a
    time in one tensor."""
    rows = logp.shape[0]
    step = max(1, -(-rows // BLOCKS))
    nll_grad = logp.new_empty(min(step, rows), logp.shape[1])
    for i in range(0, rows, step):
        j = min(i + step, rows)
        part = aten.nll_loss_backward.grad_input(grad, logp[i:j], target[i:j], None, reduction, IGNORE_INDEX,
                                                 total_weight, grad_input=nll_grad[:j - i])
        aten._log_softmax_backward_data.out(part, logp[i:j], 1, logp.dtype, out=logp[i:j])
    return logp


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """In float32 (float64 stays so), as transformers' loss; over the float32 copy of half-precision logits."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(x, 1) if x is logits else aten._log_softmax.out(x, 1, False, out=x)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(logits.float(), target, ignore_index=-100, reduction=reduction)` (float64 logits stay so)
    for 2-d logits (rows x classes)."""
    return _CrossEntropy.apply(logits, target, reduction)
