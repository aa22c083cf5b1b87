"""The walk path: a long window trained in chunks over a persistent cache.

Each chunk of `ubatch` tokens is one traced step. Attention layers write the chunk's
K/V rows in place into a preallocated per-layer cache (`index_copy_` at the chunk's
positions: the reference's SET_ROWS) and attend over the cache up to each query's
position (sliding-window layers too: their cache holds the whole window, their mask
applies the window). Recurrent layers (gated delta-net, Mamba-2, LFM2 conv) read their conv and recurrent state from
the previous chunk and write the new state in place. Earlier chunks' rows and states
are placeholders without gradient: constants for this chunk's backward.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException

from remat.capture import trace
from remat.graph import TrainGraph
from remat.hf import UnsupportedModel, model_loss, prepare
from remat.hf_cache import WalkCache, state_shapes


def new_state(model: nn.Module, batch: int, ctx: int) -> dict[str, torch.Tensor]:
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    return {k: torch.zeros(s, dtype=dtype, device=device) for k, s in state_shapes(model, batch, ctx).items()}


def chunk_loss(model: nn.Module, *inputs: torch.Tensor, names: list[str], loss_chunk: int) -> torch.Tensor:
    """The loss of one chunk: its targets' cross-entropy summed, over the window's target count."""
    *states, offset, n_targets, input_ids, labels = inputs
    prepare(model)
    chunk = input_ids.shape[1]
    cache = WalkCache(dict(zip(names, states)), offset, chunk)
    positions = cache.positions[None].expand(input_ids.shape[0], -1)
    return model_loss(model, labels, loss_chunk, n_targets, input_ids=input_ids, position_ids=positions, cache=cache,
                      use_cache=True)


def capture_chunk(model: nn.Module, batch: int, ctx: int, ubatch: int, *, loss_chunk: int = 0) -> TrainGraph:
    """Trace one chunk's step: placeholders are the model's tensors, the states, offset, target count, batch."""
    if ctx % ubatch:
        raise ValueError(f"--ctx {ctx} is not a multiple of --ubatch {ubatch}")
    shapes = state_shapes(model, batch, ctx)
    dtype = next(model.parameters()).dtype
    inputs = {name: ("state", torch.zeros(shape, dtype=dtype)) for name, shape in shapes.items()}
    inputs |= {
        "offset": ("input", torch.zeros((), dtype=torch.long)),
        "n_targets": ("input", torch.ones((), dtype=torch.float32)),
        "input_ids": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
        "labels": ("input", torch.zeros(batch, ubatch, dtype=torch.long)),
    }
    loss = functools.partial(chunk_loss, names=list(shapes), loss_chunk=loss_chunk)
    try:
        return trace(model, loss, inputs,
                     info={"shape": (batch, ubatch), "ctx": ctx, "path": "walk", "loss_chunk": loss_chunk})
    except DataDependentOutputException:
        raise UnsupportedModel(f"the walk path does not support {cast(Any, model).config.model_type}: with a cache its "
                               "positions depend on the data (learned positions read from the cache)") from None
