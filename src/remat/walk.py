"""The walk path: a long window trained in chunks over a persistent cache.

Each chunk of `ubatch` tokens is one traced step. Attention layers write the chunk's
K/V rows in place into a preallocated per-layer cache (`index_copy_` at the chunk's
positions: the reference's SET_ROWS) and attend over the cache up to each query's
position. Hybrid (gated delta-net) layers read their conv and recurrent state from
the previous chunk and write the new state in place. Earlier chunks' rows and states
are placeholders without gradient: constants for this chunk's backward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from remat.capture import TrainGraph, head_loss, prepare, trace


def state_shapes(model: nn.Module, batch: int, ctx: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every cache and state tensor the walk keeps for a window of `ctx` tokens."""
    c = model.config
    shapes: dict[str, tuple[int, ...]] = {}
    for i, kind in enumerate(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers):
        if kind == "linear_attention":
            conv_dim = 2 * c.linear_key_head_dim * c.linear_num_key_heads + c.linear_value_head_dim * c.linear_num_value_heads
            shapes[f"conv.{i}"] = (batch, conv_dim, c.linear_conv_kernel_dim)
            shapes[f"recurrent.{i}"] = (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        elif kind == "full_attention":
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            shapes[f"k.{i}"] = shapes[f"v.{i}"] = (batch, c.num_key_value_heads, ctx, head_dim)
        else:
            raise ValueError(f"the walk path does not support layers of type {kind!r}")
    return shapes


def new_state(model: nn.Module, batch: int, ctx: int) -> dict[str, torch.Tensor]:
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    return {k: torch.zeros(s, dtype=dtype, device=device) for k, s in state_shapes(model, batch, ctx).items()}


class WalkCache:
    """The cache interface transformers' attention and gated delta-net layers call, over placeholder tensors."""

    is_compileable = False

    def __init__(self, state: dict[str, torch.Tensor], offset: torch.Tensor, chunk: int):
        self.state, self.offset = state, offset
        self.positions = offset + torch.arange(chunk, device=offset.device)

    # attention layers
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.state[f"k.{layer_idx}"], self.state[f"v.{layer_idx}"]
        keys.index_copy_(2, self.positions, key_states)
        values.index_copy_(2, self.positions, value_states)
        return keys, values

    def get_query_offset(self, layer_idx: int = 0) -> torch.Tensor:
        return self.offset

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return next(t for k, t in self.state.items() if k.startswith("k.")).shape[2], 0

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self.offset

    # gated delta-net layers
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.state[f"conv.{layer_idx}"]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        # A copy: the delta rule's backward needs the state as it was at the chunk's start,
        # and this chunk overwrites the buffer in place (autograd refuses a saved tensor that
        # changed). The copy reads the buffer before that write, so the rewrite keeps it.
        return self.state[f"recurrent.{layer_idx}"].clone()

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_input: torch.Tensor, layer_idx: int, conv_kernel_size: int, **kwargs):
        conv = self.state[f"conv.{layer_idx}"]
        full = torch.cat([conv, conv_input], dim=-1)  # the previous chunk's last columns, then this chunk
        conv.copy_(full[..., -conv_kernel_size:].detach())
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, **kwargs) -> torch.Tensor:
        state = self.state[f"recurrent.{layer_idx}"]
        state.copy_(recurrent.detach())
        return state


def chunk_loss(model: nn.Module, *inputs: torch.Tensor, names: list[str], loss_chunk: int) -> torch.Tensor:
    """The loss of one chunk: its targets' cross-entropy summed, over the window's target count."""
    *states, offset, n_targets, input_ids, labels = inputs
    prepare(model)
    chunk = input_ids.shape[1]
    cache = WalkCache(dict(zip(names, states)), offset, chunk)
    positions = cache.positions[None].expand(input_ids.shape[0], -1)
    hidden = model.get_decoder()(input_ids=input_ids, position_ids=positions, cache=cache,
                                 use_cache=True).last_hidden_state
    return head_loss(model, hidden, labels, loss_chunk, n_targets)


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
    return trace(model, loss, inputs,
                 info={"shape": (batch, ubatch), "ctx": ctx, "path": "walk", "loss_chunk": loss_chunk})
