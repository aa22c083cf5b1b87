"""Cross-entropy in float32 (as transformers' loss), bit for bit as `F.cross_entropy(logits.float(), ...)`, holding
fewer logits-sized tensors at once.

The loss head is where a step peaks (SmolLM2 at 256 tokens a piece: float32 logits of 48 MiB). Autograd's
cross-entropy holds three of them in the backward: the saved log-probabilities, their gradient
(nll_loss_backward: zeros but one value a row) and the logits' gradient (`_log_softmax_backward_data`). Here the
same aten kernels run, each writing over an input nothing else reads: the logits' gradient over the
log-probabilities' (a row of it is summed before any of it is written); half-precision logits' log-softmax over
their float32 copy (a row's maximum and sum are taken before any of it is written). Half-precision logits are
saved for the backward rather than their log-probabilities (half the bytes: a loss in many pieces keeps every
piece's until the backward reaches it), and cast and log-softmaxed again there; a loss in one piece keeps the
log-probabilities (`save_log_probs`): its backward starts as its forward ends, where they are live anyway, so
they cost no byte more at the head's peak and spare the backward a cast and a log-softmax of the logits (the
default model's bfloat16 step: ~20 ms of ~1.5 s). The values are the kernels' own.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
IGNORE_INDEX = -100
_REDUCTIONS = {"mean": 1, "sum": 2}


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, reduction: str,
                save_log_probs: bool) -> torch.Tensor:
        logp = _log_softmax(logits)
        loss, _ = aten.nll_loss_forward(logp, target, None, _REDUCTIONS[reduction], IGNORE_INDEX)
        # else the cast logits: the backward casts them again (their bytes are half the log-probabilities')
        ctx.save_for_backward(logp if save_log_probs or logp.dtype == logits.dtype else logits, target)
        ctx.reduction, ctx.logits_dtype = _REDUCTIONS[reduction], logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        saved, target = ctx.saved_tensors
        logp = _log_softmax(saved) if saved.dtype != grad.dtype else saved
        # the targets counted (nll_loss_forward's total weight, without weights): not saved from the forward, whose
        # node a rewrite would make again in the backward, holding the log-probabilities it reads until then
        total_weight = (target != IGNORE_INDEX).sum().to(logp.dtype)
        d = aten.nll_loss_backward(grad, logp, target, None, ctx.reduction, IGNORE_INDEX, total_weight)
        d = aten._log_softmax_backward_data.out(d, logp, 1, logp.dtype, out=d)
        return d.to(ctx.logits_dtype), None, None, None


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """In float32 (float64 stays so), as transformers' loss; over the float32 copy of half-precision logits."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(x, 1) if x is logits else aten._log_softmax.out(x, 1, False, out=x)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                  save_log_probs: bool = False) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), target, ignore_index=-100, reduction=reduction)` (float64 logits stay so)
    for 2-d logits (rows x classes). `save_log_probs`: half-precision logits' backward reads their float32
    log-probabilities kept from the forward, not made again (for a loss whose backward starts as it ends)."""
    return _CrossEntropy.apply(logits, target, reduction, save_log_probs)
