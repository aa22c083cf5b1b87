"""The walk path: a long window trained in chunks over a persistent cache.

Each chunk of `ubatch` tokens is one traced step. Attention layers keep the window's K/V rows
in a preallocated per-layer cache (sliding-window layers too: their cache holds the whole
window, their mask applies the window); recurrent layers (gated delta-net, Mamba-2, LFM2 conv)
carry their conv and recurrent state from one chunk to the next. Two walks (docs/architecture.md,
"The walk"):

- exact (default): a forward sweep (the decoder alone, without grad) writes every chunk's K/V rows
  and records each chunk's start state; then each chunk's step runs in reverse order, recomputing
  the chunk from its tokens, the cache and its start state, with the gradient that later chunks sent
  to its K/V rows and end state added to its loss's. The step adds its gradient for the cache into a
  buffer (in place, a layer at a time) and hands its start state's gradient to the chunk before: the
  window's gradient, in one chunk's graph.
- truncated (the reference's): each chunk's step in order writes its K/V rows and state in place;
  earlier chunks' rows and states are constants for its backward. The loss is the window's, the
  gradient drops what later queries send to earlier keys, values and states.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from remat.core import alias
from remat.core.capture import Seeded, into, reads_values, trace
from remat.core.graph import StepInputs, TrainGraph
from remat.models.hf import UnsupportedModel, decoder_of, model_loss, prepare
from remat.models.hf_cache import ExactWalkCache, WalkCache, state_shapes
from remat.models.stored import compute_dtype

KV = ("k.", "v.")  # cache names of attention layers' keys and values; the others are carried states


def new_state(model: nn.Module, batch: int, ctx: int) -> dict[str, torch.Tensor]:
    dtype, device = compute_dtype(model), next(model.parameters()).device
    return {k: torch.zeros(s, dtype=dtype, device=device) for k, s in state_shapes(model, batch, ctx).items()}


def carried(names: list[str]) -> list[str]:
    """The states a chunk hands to the next (conv, recurrent): everything but the K/V cache."""
    return [k for k in names if not k.startswith(KV)]


def _loss(model: nn.Module, cache: WalkCache, n_targets: torch.Tensor, input_ids: torch.Tensor,
          labels: torch.Tensor, loss_chunk: int) -> torch.Tensor:
    positions = cache.positions[None].expand(input_ids.shape[0], -1)
    return model_loss(model, labels, loss_chunk, n_targets, input_ids=input_ids, position_ids=positions, cache=cache,
                      use_cache=True)


def chunk_loss(model: nn.Module, *inputs: torch.Tensor, names: list[str], loss_chunk: int) -> torch.Tensor:
    """The truncated walk's chunk: its targets' cross-entropy summed, over the window's target count."""
    *states, offset, n_targets, input_ids, labels = inputs
    prepare(model)
    cache = WalkCache(dict(zip(names, states)), offset, input_ids.shape[1])
    return _loss(model, cache, n_targets, input_ids, labels, loss_chunk)


def exact_chunk_loss(model: nn.Module, *inputs: torch.Tensor, names: list[str], loss_chunk: int) -> Seeded:
    """The exact walk's chunk: its loss, seeded with the gradient later chunks sent to what it made.

    Inputs: the cache and this chunk's start states (`names`), their gradient buffers (`grad.*`: the
    cache's, accumulated; at the carried states, the gradient arriving at this chunk's end state), the
    buffers this chunk's start-state gradient goes to (`grad_start.*`), then offset, targets and batch.
    """
    n, m = len(names), len(carried(names))
    state, grad = dict(zip(names, inputs[:n])), dict(zip(names, inputs[n:2 * n]))
    grad_start = dict(zip(carried(names), inputs[2 * n:2 * n + m]))
    offset, n_targets, input_ids, labels = inputs[2 * n + m:]
    prepare(model)
    # the gradient leaving the step: the cache's added into its buffer (rows of earlier chunks), the start
    # state's copied for the chunk before, each the moment the backward makes it
    for k in names:
        state[k].register_hook(into(grad[k]) if k.startswith(KV) else into(grad_start[k], add=False))
    cache = ExactWalkCache(state, offset, input_ids.shape[1])
    loss = _loss(model, cache, n_targets, input_ids, labels, loss_chunk)
    # later chunks' gradient: at this chunk's own K/V rows of the cache's buffer, and at its end state
    arriving = [grad[k].index_select(2, cache.positions) if k.startswith(KV) else grad[k] for k in cache.made]
    return Seeded(loss, tuple(cache.made.values()), tuple(arriving), tuple(state.values()))


def capture_chunk(model: nn.Module, batch: int, ctx: int, ubatch: int, *, loss_chunk: int = 0,
                  exact: bool = False) -> TrainGraph:
    """Trace one chunk's step: placeholders are the model's tensors, the states (and, exact, their
    gradient buffers), offset, target count, batch, then the window's gradient sums (`capture.trace`'s
    `accumulate`: the chunk adds its grads into them and returns them)."""
    if ctx % ubatch:
        raise ValueError(f"--ctx {ctx} is not a multiple of --ubatch {ubatch}")
    shapes = state_shapes(model, batch, ctx)
    dtype = compute_dtype(model)
    names = list(shapes)
    # exact: the cache and start states are differentiated (their gradient leaves the step into the buffers)
    inputs = {name: ("state", torch.zeros(shape, dtype=dtype, requires_grad=exact)) for name, shape in shapes.items()}
    if exact:
        inputs |= {f"grad.{k}": ("state", torch.zeros(shapes[k], dtype=dtype)) for k in names}
        inputs |= {f"grad_start.{k}": ("state", torch.zeros(shapes[k], dtype=dtype)) for k in carried(names)}
    inputs |= {
        "offset": ("input", torch.zeros((), dtype=torch.long)),
        "n_targets": ("input", torch.ones((), dtype=torch.float32)),
        "input_ids": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
        "labels": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
    }
    loss = functools.partial(exact_chunk_loss if exact else chunk_loss, names=names, loss_chunk=loss_chunk)
    # the exact walk keeps every chunk's start state from the forward sweep (the graph sees one of them)
    starts = ctx // ubatch * sum(inputs[k][1].nbytes for k in carried(names)) if exact else 0
    info = {"shape": (batch, ubatch), "ctx": ctx, "path": "walk", "walk": "exact" if exact else "truncated",
            "loss_chunk": loss_chunk, "saved_states": starts}
    try:
        tg = trace(model, loss, inputs, info=info, accumulate=True)  # one set of grads: the window's sums
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        # with a cache: learned positions read from the cache's length (MPT, XGLM), or routing read as values
        raise UnsupportedModel(f"the walk path does not support {reads_values(model, e)}") from None
    if exact and (random := next((n for n in tg.graph.nodes if alias.is_random(n)), None)):
        raise UnsupportedModel(f"the walk path does not support random ops in the exact walk ({random.target}: "
                               "dropout, sampled routing): its forward sweep and each chunk's recompute would draw "
                               "different values; set dropout to 0 or use --walk truncated")
    return tg


class Walk:
    """A window's chunks, in the order their steps run, and the buffers that pass between them."""

    def __init__(self, model: nn.Module, batch: int, ctx: int, ubatch: int, exact: bool):
        self.model, self.ctx, self.ubatch, self.exact = model, ctx, ubatch, exact
        self.params = list(StepInputs.of(model).trainable.values())
        self.state = new_state(model, batch, ctx)
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
        with torch.no_grad():
            for start in range(0, self.ctx, self.ubatch):
                before_chunk()
                start_states.append({k: self.state[k].clone() for k in self.carried})
                cache = WalkCache(self.state, torch.tensor(start), self.ubatch)
                ids = input_ids[:, start:start + self.ubatch]
                decoder(input_ids=ids, position_ids=cache.positions[None].expand(ids.shape[0], -1), cache=cache,
                        use_cache=True)
        return start_states
