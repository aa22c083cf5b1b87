"""The walk path: a long window trained in chunks over a persistent cache.

Each chunk of `ubatch` tokens is one traced step (`models.steps.chunk_step`). Attention layers keep the window's
K/V rows in a preallocated per-layer cache (sliding-window layers too: their cache holds the whole window, their
mask applies the window); recurrent layers (gated delta-net, Mamba-2, LFM2 conv) carry their conv and recurrent
state from one chunk to the next. `Walk` holds those buffers and yields each chunk's inputs in the order the steps
run: in order (truncated), or after a forward sweep, in reverse order (exact; docs/architecture.md, "The walk").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from remat.core.graph import StepInputs
from remat.models.hf import decoder_of
from remat.models.hf_cache import Probes, WalkCache
from remat.models.steps import KV, carried, in_compute_dtype, new_state
from remat.models.stored import made_in


class Walk:
    """A window's chunks, in the order their steps run, and the buffers that pass between them."""

    def __init__(self, model: nn.Module, batch: int, ctx: int, ubatch: int, exact: bool, probes: Probes | None = None,
                 dtype: torch.dtype = torch.float32):
        self.model, self.ctx, self.ubatch, self.exact, self.dtype = model, ctx, ubatch, exact, dtype
        self.params = list(StepInputs.of(model).trainable.values())
        self.state = new_state(model, batch, ctx, probes, dtype)
        self.carried = carried(list(self.state))
        self.grad = {k: torch.zeros_like(t) for k, t in self.state.items()} if exact else {}
        self.grad_start = {k: torch.zeros_like(self.state[k]) for k in self.carried} if exact else {}

    def chunks(self, input_ids: torch.Tensor, labels: torch.Tensor,
               before_chunk: Callable[[], None]) -> Iterator[list[torch.Tensor]]:
        """The inputs of each chunk's step (after the model's tensors), one step run between two of them.

        The last inputs are the window's gradient sums, new for each window (the caller may still hold
        the last window's); every chunk's step returns them, the last one the window's grads."""
        for t in (*self.state.values(), *self.grad.values()):
            t.zero_()  # a new window: no cache or state carried in from the last one, no gradient yet
        n_targets = (labels != -100).sum().to(torch.float32)
        starts = range(0, self.ctx, self.ubatch)
        sums = [torch.zeros_like(p) for p in self.params]

        def batch(start: int) -> list[torch.Tensor]:
            return [torch.tensor(start), n_targets,
                    *(t[:, start:start + self.ubatch].contiguous() for t in (input_ids, labels)), *sums]

        if not self.exact:
            for start in starts:
                yield [*self.state.values(), *batch(start)]
            return
        start_states = self.forward_sweep(input_ids, before_chunk)
        kv = {k: t for k, t in self.state.items() if k.startswith(KV)}
        for start, begun in zip(reversed(starts), reversed(start_states)):
            for t in self.grad_start.values():
                t.zero_()  # a state the step does not read gets no gradient
            state = [kv[k] if k in kv else begun[k] for k in self.state]
            yield [*state, *self.grad.values(), *self.grad_start.values(), *batch(start)]
            # the gradient at this chunk's start state is the one arriving at the chunk before's end state
            for k in self.carried:
                self.grad[k], self.grad_start[k] = self.grad_start[k], self.grad[k]

    def forward_sweep(self, input_ids: torch.Tensor, before_chunk: Callable[[], None]) -> list[dict[str, torch.Tensor]]:
        """Run the decoder over the chunks in order, without grad: write the window's K/V rows into the
        cache, and return each chunk's start state (conv, recurrent)."""
        decoder = decoder_of(self.model)
        start_states = []
        with torch.no_grad(), made_in(decoder, self.dtype):  # in the dtype each chunk's step computes in
            for start in range(0, self.ctx, self.ubatch):
                before_chunk()
                start_states.append({k: self.state[k].clone() for k in self.carried})
                cache = WalkCache(self.state, torch.tensor(start), self.ubatch)
                ids = input_ids[:, start:start + self.ubatch]
                in_compute_dtype(nn.Module.__call__, self.dtype, decoder, input_ids=ids, cache=cache, use_cache=True,
                                 position_ids=cache.positions[None].expand(ids.shape[0], -1))
        return start_states
