"""A causal LM's train step, traced: over a whole window (`window_step`), or over one chunk of the walk
(`chunk_step`; `remat.training.walk` runs them).

Each prepares the model (its layer marks, remat's attention: `hf.prepare`), swaps in the ops that recompute
inside (`delta_rule`, with their workspaces for the planner) and traces the model's own loss through
`core.capture.trace`. A planner hands in its recorder (`remat.fastplan.record`); called without one, make_fx
traces (the tests' oracle).

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

from remat.core import attention, precision
from remat.core.capture import Recorder, Seeded, into, trace
from remat.core.graph import TrainGraph
from remat.models import delta_rule
from remat.models.hf import UnsupportedModel, causal_lm, causal_lm_loss, model_loss, prepare
from remat.models.hf_cache import ExactWalkCache, Probes, WalkCache, state_layer, walking
from remat.models.stored import compute_dtype, made_in


def window_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *, loss_chunk: int = 0,
                recorder: Recorder | None = None, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> TrainGraph:
    """Trace the train step of `model` on a batch of this shape into a TrainGraph, for the step to run on
    `device` (default: where the model is; its kernels: `hf.prepare`, `core.attention`), its forward computing in
    `dtype` (`remat.core.precision`: autocast's mixed precision; float32 traces the model as it is).

    Nothing of the step is computed: tracing runs on FakeTensors, and each node's
    `meta["val"]` carries shape, dtype, strides and storage for the planner.
    """
    try:
        return _traced(model, functools.partial(causal_lm_loss, loss_chunk=loss_chunk),
                       {"input_ids": ("input", input_ids), "labels": ("input", labels)}, recorder, device, dtype,
                       info={"shape": tuple(input_ids.shape), "loss_chunk": loss_chunk})
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise UnsupportedModel(reads_values(model, e)) from None


def _traced(model: nn.Module, loss_fn, inputs: dict, recorder: Recorder | None, device: torch.device | None,
            dtype: torch.dtype, **kwargs) -> TrainGraph:
    device = device or next(model.parameters()).device
    prepare(model, device)  # the marks and attention, before the tensors are listed
    if dtype != torch.float32:  # the forward reads the weights in the compute dtype (`remat.core.precision`)
        loss_fn = functools.partial(in_compute_dtype, loss_fn, dtype)
    # what the attention kernels remat chooses on the device hold inside (none on the CPU)
    held = {**delta_rule.WORKSPACES, **attention.workspaces(device)}
    with delta_rule.swapped(model), made_in(model, dtype):
        tg = trace(model, loss_fn, inputs, recorder=recorder, workspaces=held, **kwargs)
    if dtype != torch.float32:
        precision.casts_where_read(tg)
        precision.upcasts_where_made(tg)
    return tg


class _Call(nn.Module):
    # functional_call swaps tensors on a module's whole tree: `fn(module, ...)` as one call on it.
    def __init__(self, module: nn.Module, fn):
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


def in_compute_dtype(fn, dtype: torch.dtype, module: nn.Module, *args, **kwargs):
    """`fn(module, *args, **kwargs)` with every float parameter of the module read in `dtype`: cast once (tied
    weights share the cast), its gradient flowing back through the cast in its own dtype. Stored weights are made in
    `dtype` by the caller (`stored.made_in`)."""
    if dtype == torch.float32:  # a float32 step computes as the model is (a float64 one too): the call as it is
        return fn(module, *args, **kwargs)
    cast = {f"module.{name}": p.to(dtype) for name, p in module.named_parameters()
            if p.is_floating_point() and p.dtype != dtype}
    return torch.func.functional_call(_Call(module, fn), cast, args, kwargs, strict=False)


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


KV = ("k.", "v.", "index.")  # the window's caches (`hf_cache.ROWS`): attention's keys and values, an indexer's keys
CONSTANT = ("index.",)  # caches no gradient reaches (a sparse-attention indexer scores its keys without grad)


def state_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the walk's cache and states: what the step computes in (a float32 step: the model's own)."""
    return compute_dtype(model) if dtype == torch.float32 else dtype


def new_state(model: nn.Module, batch: int, ctx: int, probes: Probes | None = None,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The walk's cache and carried states for a window, zeroed, for a step computing in `dtype`."""
    held, device = state_dtype(model, dtype), next(model.parameters()).device  # quant: a first parameter may be bytes
    shapes = (probes or Probes(model)).state_shapes(batch, ctx)
    return {k: torch.zeros(s, dtype=held, device=device) for k, s in shapes.items()}


def carried(names: list[str]) -> list[str]:
    """The states a chunk hands to the next (conv, recurrent): everything but the K/V cache."""
    return [k for k in names if not k.startswith(KV)]


def differentiated(names: list[str]) -> list[str]:
    """The states the exact walk sends a gradient through (with a gradient buffer each): all but `CONSTANT`."""
    return [k for k in names if not k.startswith(CONSTANT)]


def _loss(model: nn.Module, cache: WalkCache, n_targets: torch.Tensor, input_ids: torch.Tensor,
          labels: torch.Tensor, loss_chunk: int) -> torch.Tensor:
    positions = cache.positions[None].expand(input_ids.shape[0], -1)
    return model_loss(model, labels, loss_chunk, n_targets, input_ids=input_ids, position_ids=positions, cache=cache,
                      use_cache=True)


def chunk_loss(model: nn.Module, *inputs: torch.Tensor, names: list[str], loss_chunk: int,
               cache_class: type[WalkCache] = WalkCache) -> torch.Tensor:
    """The truncated walk's chunk: its targets' cross-entropy summed, over the window's target count."""
    *states, offset, n_targets, input_ids, labels = inputs
    cache = cache_class(dict(zip(names, states)), offset, input_ids.shape[1])
    return _loss(model, cache, n_targets, input_ids, labels, loss_chunk)


def exact_chunk_loss(model: nn.Module, *inputs: torch.Tensor, names: list[str], loss_chunk: int,
                     cache_class: type[ExactWalkCache] = ExactWalkCache) -> Seeded:
    """The exact walk's chunk: its loss, seeded with the gradient later chunks sent to what it made.

    Inputs: the cache and this chunk's start states (`names`), their gradient buffers (`grad.*`, `differentiated`: the
    cache's, accumulated; at the carried states, the gradient arriving at this chunk's end state), the
    buffers this chunk's start-state gradient goes to (`grad_start.*`), then offset, targets and batch.
    """
    n, d, m = len(names), len(differentiated(names)), len(carried(names))
    state, grad = dict(zip(names, inputs[:n])), dict(zip(differentiated(names), inputs[n:n + d]))
    grad_start = dict(zip(carried(names), inputs[n + d:n + d + m]))
    offset, n_targets, input_ids, labels = inputs[n + d + m:]
    # the gradient leaving the step: the cache's added into its buffer (rows of earlier chunks), the start
    # state's copied for the chunk before, each the moment the backward makes it
    for k in grad:
        state[k].register_hook(into(grad[k]) if k.startswith(KV) else into(grad_start[k], add=False))
    cache = cache_class(state, offset, input_ids.shape[1])
    loss = _loss(model, cache, n_targets, input_ids, labels, loss_chunk)
    # later chunks' gradient: at this chunk's own K/V rows of the cache's buffer, read when the layer's backward
    # reaches them (read at the step's start, every layer's rows were alive through the loss head's backward);
    # at its end state, the buffer itself. What a layer makes without grad (HRM's no-grad cycles) passes none
    # on: later chunks read it as a constant.
    made = {k: t for k, t in cache.made.items() if t.requires_grad}
    for k, t in made.items():
        if k.startswith(KV):
            t.register_hook(_arriving(grad[k], offset, input_ids.shape[1]))
    ends = [k for k in made if not k.startswith(KV)]
    return Seeded(loss, tuple(made[k] for k in ends), tuple(grad[k] for k in ends), tuple(state[k] for k in grad))


def _arriving(buffer: torch.Tensor, offset: torch.Tensor, chunk: int):
    """A gradient hook on a chunk's own K or V rows: what later chunks sent them, added. The rows' positions are
    made here, in the layer's backward, from the offset (not read from the forward's: a node every layer's backward
    read would not belong to one layer, and a stamped plan splits the step by layer)."""
    return lambda g: g + buffer.index_select(2, offset + torch.arange(chunk, device=offset.device))


def chunk_inputs(model: nn.Module, shapes: dict[str, tuple[int, ...]], batch: int, ubatch: int, exact: bool,
                 dtype: torch.dtype = torch.float32) -> dict[str, tuple[str, torch.Tensor]]:
    """A walk chunk's step inputs after the model's tensors, by name: (role, an example of its shape, not filled):
    the states (exact: those `differentiated`, then their gradient buffers and the start states' buffers), offset,
    target count and batch. A model on fake weights gets fake ones: a plan allocates nothing of the cache's size."""
    held = state_dtype(model, dtype)  # a step computing in `dtype` holds its states in it
    mode = next((p.fake_mode for p in model.parameters() if isinstance(p, FakeTensor)), None)
    names = list(shapes)
    graded = differentiated(names) if exact else []
    with mode if mode is not None else contextlib.nullcontext():
        # exact: the cache and start states are differentiated (their gradient leaves the step into the buffers)
        inputs = {k: ("state", torch.empty(shape, dtype=held, requires_grad=k in graded))
                  for k, shape in shapes.items()}
        if exact:
            inputs |= {f"grad.{k}": ("state", torch.empty(shapes[k], dtype=held)) for k in graded}
            inputs |= {f"grad_start.{k}": ("state", torch.empty(shapes[k], dtype=held)) for k in carried(names)}
        return inputs | {
            "offset": ("input", torch.zeros((), dtype=torch.long)),
            "n_targets": ("input", torch.ones((), dtype=torch.float32)),
            "input_ids": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
            "labels": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
        }


def chunk_step(model: nn.Module, batch: int, ctx: int, ubatch: int, *, loss_chunk: int = 0, exact: bool = False,
               probes: Probes | None = None, recorder: Recorder | None = None,
               device: torch.device | None = None, dtype: torch.dtype = torch.float32,
               layers: Collection[int] | None = None) -> TrainGraph:
    """Trace one walk chunk's step: placeholders are the model's tensors, the states (and, exact, their
    gradient buffers), offset, target count, batch, then the window's gradient sums (`capture.trace`'s
    `accumulate`: the chunk adds its grads into them and returns them). `device`: as `window_step`'s. `layers`:
    the decoder runs only these (a stamped plan's small trace, `fastplan.stamp`): the other layers' states are not
    its inputs."""
    if ctx % ubatch:
        raise ValueError(f"--ctx {ctx} is not a multiple of --ubatch {ubatch}")
    probes = probes or Probes(model)
    every = probes.state_shapes(batch, ctx)
    shapes = every if layers is None else {k: v for k, v in every.items() if state_layer(k) in layers}
    names = list(shapes)
    inputs = chunk_inputs(model, shapes, batch, ubatch, exact, dtype)
    loss = (functools.partial(exact_chunk_loss, cache_class=probes.cache(ExactWalkCache)) if exact
            else functools.partial(chunk_loss, cache_class=probes.cache(WalkCache)))
    loss = functools.partial(loss, names=names, loss_chunk=loss_chunk)
    # the exact walk keeps every chunk's start state from the forward sweep (the graph sees one of them)
    itemsize = state_dtype(model, dtype).itemsize
    starts = ctx // ubatch * sum(math.prod(every[k]) * itemsize for k in carried(list(every))) if exact else 0
    info = {"shape": (batch, ubatch), "ctx": ctx, "path": "walk", "walk": "exact" if exact else "truncated",
            "loss_chunk": loss_chunk, "saved_states": starts}
    try:
        with walking(model):  # Mamba's scans from the carried state, GPT-Neo's masks by positions
            # one set of grads: the window's sums
            return _traced(model, loss, inputs, recorder, device, dtype, info=info, accumulate=True)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        # with a cache: learned positions read from the cache's length (MPT, XGLM), or routing read as values
        raise UnsupportedModel(f"the walk path does not support {reads_values(model, e)}") from None


