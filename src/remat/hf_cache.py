"""transformers' cache interface for the walk: the shapes of every state a model's layers keep, and the cache
that attention and recurrent layers call over the walk's persistent buffers (beside `hf`, whose functions it uses)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.hf import UnsupportedModel, causal_lm, decoder_layers, prepare
from remat.settings import one_line


class _ProbeCache:
    """The walk's cache interface on an empty cache, recording the shape of every state a layer writes."""

    is_compileable = False

    def __init__(self):
        self.shapes: dict[str, tuple[int, ...]] = {}

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.shapes[f"k.{layer_idx}"], self.shapes[f"v.{layer_idx}"] = key_states.shape, value_states.shape
        return key_states, value_states

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_input, layer_idx: int, conv_kernel_size: int, **kwargs):
        self.shapes[f"conv.{layer_idx}"] = (*conv_input.shape[:-1], conv_kernel_size)
        return torch.cat([conv_input.new_zeros(*conv_input.shape[:-1], conv_kernel_size), conv_input], dim=-1)

    def update_recurrent_state(self, recurrent, layer_idx: int, **kwargs):
        self.shapes[f"recurrent.{layer_idx}"] = recurrent.shape
        return recurrent


def _without_initial_state(layer: nn.Module) -> str | None:
    """The class of a recurrent mixer in `layer` whose sequence scan does not start from the carried state."""
    for m in layer.modules():
        try:
            source = inspect.getsource(type(m))
        except (OSError, TypeError):
            continue
        if "update_recurrent_state" in source and "initial_state" not in source:
            return type(m).__name__
    return None


def _probe(lm: Any, batch: int) -> dict[str, tuple[int, ...]]:
    """Run the decoder on two tokens over a probe cache: the shape of every state its layers keep."""
    cache = _ProbeCache()
    params = [p for p in lm.parameters()]
    mode = next((p.fake_mode for p in params if isinstance(p, FakeTensor)), None)
    device = params[0].device
    ids = torch.zeros(batch, 2, dtype=torch.long, device=device)
    positions = torch.arange(2, device=device)[None].expand(batch, -1)
    with torch.no_grad(), mode if mode is not None else contextlib.nullcontext():
        lm.get_decoder()(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
    return cache.shapes


def state_shapes(model: nn.Module, batch: int, ctx: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every cache and state tensor the walk keeps for a window of `ctx` tokens.

    Read off the model itself: its decoder runs on two tokens over a probe cache, and each
    attention layer's K/V (full window: sliding-window layers keep every row and apply their
    window in the mask), conv state and recurrent state is recorded as the layer writes it.
    Refuses, naming the feature, what a chunk cannot carry over to the next.
    """
    lm = causal_lm(model)
    prepare(lm)
    if getattr(lm.config, "output_router_logits", False):
        raise UnsupportedModel("the walk path does not support a router aux loss (output_router_logits): "
                               "it is a function of the whole window's routing")
    cached = lm.__dict__.setdefault("_remat_state_shapes", {})
    if batch not in cached:
        try:
            cached[batch] = _probe(lm, batch)
        except (AttributeError, TypeError, NotImplementedError, ValueError, RuntimeError) as e:
            raise UnsupportedModel(f"the walk path does not support {lm.config.model_type}: its layers call the "
                                   f"cache in a way the walk does not know ({type(e).__name__}: "
                                   f"{one_line(e, 160)})") from None
    shapes = cached[batch]
    layers = decoder_layers(lm)
    for i, layer in enumerate(layers):
        if f"recurrent.{i}" in shapes and (cls := _without_initial_state(layer)):
            raise UnsupportedModel(f"the walk path does not support {cls} layers: their sequence scan does not "
                                   "start from the state carried in from the previous chunk")
    if not shapes:
        raise UnsupportedModel(f"the walk path does not support {lm.config.model_type}: its layers keep no cache")
    return {k: (*v[:2], ctx, *v[3:]) if k[:2] in ("k.", "v.") else tuple(v) for k, v in shapes.items()}


class WalkCache:
    """The cache interface transformers' attention and recurrent layers call, over placeholder tensors."""

    is_compileable = False

    def __init__(self, state: dict[str, torch.Tensor], offset: torch.Tensor, chunk: int):
        self.state, self.offset = state, offset
        self.ctx = next((t.shape[2] for k, t in state.items() if k.startswith("k.")), 0)
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
        return self.ctx, 0  # every attention layer, sliding ones too, attends over the whole window's cache

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


class ExactWalkCache(WalkCache):
    """The exact walk's cache for one chunk's step in the reverse sweep (`remat.walk`).

    It writes nothing: the window's K/V rows are in the cache already (the forward sweep wrote them)
    and the chunk starts from the state recorded for it. This chunk's own K/V rows are put in place
    out of place, so that its queries' gradient reaches them; `made` holds what the chunk adds (its
    K/V rows, its end state), where later chunks' gradient arrives.
    """

    def __init__(self, state: dict[str, torch.Tensor], offset: torch.Tensor, chunk: int):
        super().__init__(state, offset, chunk)
        self.made: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = f"k.{layer_idx}", f"v.{layer_idx}"
        self.made[k], self.made[v] = key_states, value_states
        return (self.state[k].index_copy(2, self.positions, key_states),
                self.state[v].index_copy(2, self.positions, value_states))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.state[f"recurrent.{layer_idx}"]  # nothing overwrites it in this step

    def update_conv_state(self, conv_input: torch.Tensor, layer_idx: int, conv_kernel_size: int, **kwargs):
        full = torch.cat([self.state[f"conv.{layer_idx}"], conv_input], dim=-1)
        self.made[f"conv.{layer_idx}"] = full[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, **kwargs) -> torch.Tensor:
        self.made[f"recurrent.{layer_idx}"] = recurrent
        return recurrent
