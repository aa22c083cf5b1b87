"""A causal LM's train step, traced: over a whole window (`window_step`), or over one chunk of the walk
(`chunk_step`; `remat.training.walk` runs them).

Each prepares the model (its layer marks, remat's attention: `hf.prepare`), swaps in the ops that recompute
inside (`delta_rule`, with their workspaces for the planner) and traces the model's own loss through
`core.capture.trace`. A planner hands in its recorder (`remat.fastplan.record`) for models on fake weights.

The walk's chunks (docs/architecture.md, "The walk"):
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

import contextlib
import functools
import linecache
import math
import traceback
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor

from remat.core import alias
from remat.core.capture import Recorder, Seeded, into, trace
from remat.core.graph import TrainGraph
from remat.models import delta_rule
from remat.models.hf import UnsupportedModel, causal_lm, causal_lm_loss, model_loss, prepare
from remat.models.hf_cache import ExactWalkCache, Probes, WalkCache


def window_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *, loss_chunk: int = 0,
                recorder: Recorder | None = None) -> TrainGraph:
    """Trace the train step of `model` on a batch of this shape into a TrainGraph.

    Nothing of the step is computed: tracing runs on FakeTensors, and each node's
    `meta["val"]` carries shape, dtype, strides and storage for the planner.
    """
    try:
        return _traced(model, functools.partial(causal_lm_loss, loss_chunk=loss_chunk),
                       {"input_ids": ("input", input_ids), "labels": ("input", labels)}, recorder,
                       info={"shape": tuple(input_ids.shape), "loss_chunk": loss_chunk})
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise UnsupportedModel(reads_values(model, e)) from None


def _traced(model: nn.Module, loss_fn, inputs: dict, recorder: Recorder | None, **kwargs) -> TrainGraph:
    prepare(model)  # the marks and attention, before the tensors are listed
    with delta_rule.swapped(model):
        return trace(model, loss_fn, inputs, recorder=recorder, workspaces=delta_rule.WORKSPACES, **kwargs)


def reads_values(model: nn.Module, e: BaseException) -> str:
    """The refusal for a model whose forward reads tensor values to decide what it computes (a Python list of
    sizes, a data-dependent shape: JetMoE's routing), which a traced step, on values-free tensors, cannot follow.
    It names the model's own code: the innermost frame of the traceback outside torch and remat."""
    where, skip = "its forward", (Path(torch.__file__).parent, Path(__file__).parents[1])
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        path = Path(frame.f_code.co_filename)
        if not any(path.is_relative_to(d) for d in skip):
            owner = frame.f_locals.get("self")
            line = linecache.getline(str(path), lineno).strip()[:100]
            where = f"{type(owner).__name__ if owner is not None else path.stem} (`{line}`, {path.name}:{lineno})"
    name = getattr(getattr(causal_lm(model), "config", None), "model_type", type(model).__name__)
    return (f"{name}: {where} reads tensor values to decide what it computes (data-dependent), which a traced "
            "step cannot follow")


KV = ("k.", "v.")  # cache names of attention layers' keys and values; the others are carried states


def new_state(model: nn.Module, batch: int, ctx: int, probes: Probes | None = None) -> dict[str, torch.Tensor]:
    """The walk's cache and carried states for a window, zeroed."""
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    shapes = (probes or Probes(model)).state_shapes(batch, ctx)
    return {k: torch.zeros(s, dtype=dtype, device=device) for k, s in shapes.items()}


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
    # the gradient leaving the step: the cache's added into its buffer (rows of earlier chunks), the start
    # state's copied for the chunk before, each the moment the backward makes it
    for k in names:
        state[k].register_hook(into(grad[k]) if k.startswith(KV) else into(grad_start[k], add=False))
    cache = ExactWalkCache(state, offset, input_ids.shape[1])
    loss = _loss(model, cache, n_targets, input_ids, labels, loss_chunk)
    # later chunks' gradient: at this chunk's own K/V rows of the cache's buffer, read when the layer's backward
    # reaches them (read at the step's start, every layer's rows were alive through the loss head's backward);
    # at its end state, the buffer itself
    for k, made in cache.made.items():
        if k.startswith(KV):
            made.register_hook(_arriving(grad[k], offset, input_ids.shape[1]))
    ends = [k for k in cache.made if not k.startswith(KV)]
    return Seeded(loss, tuple(cache.made[k] for k in ends), tuple(grad[k] for k in ends), tuple(state.values()))


def _arriving(buffer: torch.Tensor, offset: torch.Tensor, chunk: int):
    """A gradient hook on a chunk's own K or V rows: what later chunks sent them, added. The rows' positions are
    made here, in the layer's backward, from the offset (not read from the forward's: a node every layer's backward
    read would not belong to one layer, and a stamped plan splits the step by layer)."""
    return lambda g: g + buffer.index_select(2, offset + torch.arange(chunk, device=offset.device))


def state_layer(name: str) -> int:
    """The layer a walk state belongs to, by its name (`k.3`, `recurrent.3`, `conv.3.1`, `grad.k.3`, ...)."""
    return int(name.removeprefix("grad_start.").removeprefix("grad.").split(".")[1])


def chunk_inputs(model: nn.Module, shapes: dict[str, tuple[int, ...]], batch: int, ubatch: int,
                 exact: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """A walk chunk's step inputs after the model's tensors, by name: (role, an example of its shape, not filled):
    the states (exact: differentiated, then their gradient buffers and the start states' buffers), offset, target
    count and batch. A model on fake weights gets fake ones: a plan allocates nothing of the cache's size."""
    dtype = next(model.parameters()).dtype
    mode = next((p.fake_mode for p in model.parameters() if isinstance(p, FakeTensor)), None)
    names = list(shapes)
    with mode if mode is not None else contextlib.nullcontext():
        # exact: the cache and start states are differentiated (their gradient leaves the step into the buffers)
        inputs = {k: ("state", torch.empty(shape, dtype=dtype, requires_grad=exact)) for k, shape in shapes.items()}
        if exact:
            inputs |= {f"grad.{k}": ("state", torch.empty(shapes[k], dtype=dtype)) for k in names}
            inputs |= {f"grad_start.{k}": ("state", torch.empty(shapes[k], dtype=dtype)) for k in carried(names)}
        return inputs | {
            "offset": ("input", torch.zeros((), dtype=torch.long)),
            "n_targets": ("input", torch.ones((), dtype=torch.float32)),
            "input_ids": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
            "labels": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
        }


def chunk_step(model: nn.Module, batch: int, ctx: int, ubatch: int, *, loss_chunk: int = 0, exact: bool = False,
               probes: Probes | None = None, recorder: Recorder | None = None,
               layers: Collection[int] | None = None) -> TrainGraph:
    """Trace one walk chunk's step: placeholders are the model's tensors, the states (and, exact, their
    gradient buffers), offset, target count, batch, then the window's gradient sums (`capture.trace`'s
    `accumulate`: the chunk adds its grads into them and returns them). `layers`: the decoder runs only these
    (a stamped plan's small trace, `fastplan.stamp`): the other layers' states are not its inputs."""
    if ctx % ubatch:
        raise ValueError(f"--ctx {ctx} is not a multiple of --ubatch {ubatch}")
    every = (probes or Probes(model)).state_shapes(batch, ctx)
    shapes = every if layers is None else {k: v for k, v in every.items() if state_layer(k) in layers}
    names = list(shapes)
    inputs = chunk_inputs(model, shapes, batch, ubatch, exact)
    loss = functools.partial(exact_chunk_loss if exact else chunk_loss, names=names, loss_chunk=loss_chunk)
    # the exact walk keeps every chunk's start state from the forward sweep (the graph sees one of them)
    itemsize = next(model.parameters()).element_size()
    starts = ctx // ubatch * sum(math.prod(every[k]) * itemsize for k in carried(list(every))) if exact else 0
    info = {"shape": (batch, ubatch), "ctx": ctx, "path": "walk", "walk": "exact" if exact else "truncated",
            "loss_chunk": loss_chunk, "saved_states": starts}
    try:
        tg = _traced(model, loss, inputs, recorder, info=info, accumulate=True)  # one set: the window's sums
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        # with a cache: learned positions read from the cache's length (MPT, XGLM), or routing read as values
        raise UnsupportedModel(f"the walk path does not support {reads_values(model, e)}") from None
    if exact and (random := next((n for n in tg.graph.nodes if alias.is_random(n)), None)):
        raise UnsupportedModel(f"the walk path does not support random ops in the exact walk ({random.target}: "
                               "dropout, sampled routing): its forward sweep and each chunk's recompute would draw "
                               "different values; set dropout to 0 or use --walk truncated")
    return tg


