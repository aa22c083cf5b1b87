"""The walk path: a long window trained in chunks over a persistent cache.

Each chunk of `ubatch` tokens is one traced step (`models.steps.chunk_step`). Attention layers keep the window's
K/V rows in a preallocated per-layer cache (sliding-window layers too: their cache holds the whole window, their
mask applies the window); recurrent layers (gated delta-net, Mamba-2, LFM2 conv) carry their conv and recurrent
state from one chunk to the next. `Walk` holds those buffers and yields each chunk's inputs in the order the steps
run: in order (truncated), or after a forward sweep, in reverse order (exact; docs/architecture.md, "The walk").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from remat.core.graph import StepInputs
from remat.models.hf import decoder_of
from remat.models.hf_cache import Probes, WalkCache, walking
from remat.models.steps import KV, carried, differentiated, in_compute_dtype, new_state
from remat.models.stored import made_in


@dataclass
class Draws:
    """The state of the random generators a step draws from (the CPU's, and the model's device's): recorded as the
    forward sweep starts a chunk, replayed before that chunk's step, which then draws the same numbers (dropout,
    PhiMoE's sampled routing: the sweep and the recompute of the exact walk must compute the same function)."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    on: torch.device

    @classmethod
    def now(cls, on: torch.device) -> Draws:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state(on) if on.type == "cuda" else None, on)

    def replay(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.device, self.on)


class Walk:
    """A window's chunks, in the order their steps run, and the buffers that pass between them."""

    def __init__(self, model: nn.Module, batch: int, ctx: int, ubatch: int, exact: bool, probes: Probes | None = None,
                 dtype: torch.dtype = torch.float32):
        self.model, self.batch, self.ctx, self.ubatch, self.exact = model, batch, ctx, ubatch, exact
        self.dtype = dtype  # what each chunk's step computes in: the states are held in it
        self.probes = probes or Probes(model)
        self.params = list(StepInputs.of(model).trainable.values())
        self.device = next(model.parameters()).device
        self.draws: list[Draws] = []  # the random generators' state at each chunk's start in the forward sweep
        self.state: dict[str, torch.Tensor] = {}
        self.grad: dict[str, torch.Tensor] = {}
        self.grad_start: dict[str, torch.Tensor] = {}
        self.starts: list[dict[str, torch.Tensor]] = []  # exact: each chunk's start state, from the forward sweep
        self.carried: list[str] = []

    def chunks(self, input_ids: torch.Tensor, labels: torch.Tensor,
               before_chunk: Callable[[], None]) -> Iterator[list[torch.Tensor]]:
        """The inputs of each chunk's step (after the model's tensors), one step run between two of them.

        The last inputs are the window's gradient sums, new for each window (the caller may still hold
        the last window's); every chunk's step returns them, the last one the window's grads. The cache and
        states (exact: with their gradient buffers) are made for the window, zeroed (nothing carried in from the
        last one), and given back when its last chunk has run: the optimizer's update never holds them
        (the plan counts `cache` beside the step, not beside the update)."""
        try:
            yield from self._chunks(input_ids, labels, before_chunk)
        finally:
            self.state, self.grad, self.grad_start, self.starts, self.draws = {}, {}, {}, [], []

    def _chunks(self, input_ids: torch.Tensor, labels: torch.Tensor,
                before_chunk: Callable[[], None]) -> Iterator[list[torch.Tensor]]:
        self.state = new_state(self.model, self.batch, self.ctx, self.probes, self.dtype)
        self.carried = carried(list(self.state))
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
        self.starts = self.forward_sweep(input_ids, before_chunk)
        swept = Draws.now(self.device)
        # the gradient buffers, from the first step that adds into them
        self.grad = {k: torch.zeros_like(self.state[k]) for k in differentiated(list(self.state))}
        self.grad_start = {k: torch.zeros_like(self.state[k]) for k in self.carried}
        kv = {k: t for k, t in self.state.items() if k.startswith(KV)}
        for start, begun, drawn in zip(reversed(starts), reversed(self.starts), reversed(self.draws)):
            for t in self.grad_start.values():
                t.zero_()  # a state the step does not read gets no gradient
            state = [kv[k] if k in kv else begun[k] for k in self.state]
            drawn.replay()  # the step draws what the sweep drew for this chunk (dropout, sampled routing)
            yield [*state, *self.grad.values(), *self.grad_start.values(), *batch(start)]
            # the gradient at this chunk's start state is the one arriving at the chunk before's end state
            for k in self.carried:
                self.grad[k], self.grad_start[k] = self.grad_start[k], self.grad[k]
        swept.replay()  # what follows draws on from where the sweep left off

    def forward_sweep(self, input_ids: torch.Tensor, before_chunk: Callable[[], None]) -> list[dict[str, torch.Tensor]]:
        """Run the decoder over the chunks in order, without grad: write the window's K/V rows into the
        cache, and return each chunk's start state (conv, recurrent)."""
        decoder = decoder_of(self.model)
        start_states, self.draws = [], []
        with torch.no_grad(), walking(self.model), made_in(decoder, self.dtype):  # in the dtype the steps compute in
            for start in range(0, self.ctx, self.ubatch):
                before_chunk()
                start_states.append({k: self.state[k].clone() for k in self.carried})
                self.draws.append(Draws.now(self.device))
                cache = self.probes.cache(WalkCache)(self.state, torch.tensor(start), self.ubatch)
                ids = input_ids[:, start:start + self.ubatch]
                in_compute_dtype(nn.Module.__call__, self.dtype, decoder, input_ids=ids, cache=cache, use_cache=True,
                                 position_ids=cache.positions[None].expand(ids.shape[0], -1))
        return start_states
