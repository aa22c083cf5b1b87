"""Everything transformers-specific: attention and masks for tracing, layer marks, the loss, the walk's cache.

The rest of remat sees a causal LM only through these functions: `prepare` (once per
model), `causal_lm_loss` / `model_loss` (the step's loss), `decoder_layers`, and the
`WalkCache` that attention and recurrent layers call on the walk path.

Follow the model, don't replace it: masks are transformers' own (`sdpa_mask` with the
model's mask function: causal, sliding window, chunked), attention is SDPA or, where a
layer needs what SDPA lacks (softcapping, sinks), the model's own eager attention; the
loss reads the logits the model's own forward makes (its head, scaling and softcapping)
and adds the router loss the model adds. What remat cannot follow it refuses, naming
the feature (`UnsupportedModel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from transformers import AttentionInterface, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from remat.marks import LAYER_MARK, mark

ATTENTION = "remat"
# Mixture-of-experts layers run transformers' "batched_mm" experts: static shapes, so they trace on fake
# tensors ("grouped_mm" needs bf16 on CPU, "eager" loops over the experts a batch happens to hit).
EXPERTS = "batched_mm"


class UnsupportedModel(ValueError):
    """A model remat cannot train as the model defines it; the message names the feature, on one line."""


# ------------------------------------------------------------------------------------------ attention


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
          mask_function=causal_mask_function, attention_mask=None, local_size: int | None = None,
          allow_is_causal_skip: bool = True, use_vmap: bool = False, device=None, **kwargs):
    """transformers' own SDPA mask (sliding windows, chunks, offsets), with its skip decided on shapes only.

    transformers' "sdpa" returns no mask (SDPA's `is_causal`) when the mask is plain causal, and
    decides that partly by reading tensor values, which tracing cannot; here the same rule is
    applied to what is known without data: no padding mask, no offset, a square window no
    larger than the local attention size.
    """
    plain = (allow_is_causal_skip and attention_mask is None and isinstance(q_offset, int) and q_offset == 0
             and kv_offset == 0 and kv_length == q_length and (local_size is None or kv_length < local_size))
    if plain:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, use_vmap=use_vmap, device=device)


# Keyword arguments SDPA cannot express: an attention layer passing one of them runs its own eager attention.
_EAGER_ONLY = ("softcap", "s_aux")


def _attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, or the model's own eager attention where it needs what SDPA lacks (softcapping, sinks)."""
    if any(kwargs.get(k) is not None for k in _EAGER_ONLY):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise UnsupportedModel(f"{type(module).__name__} needs {', '.join(_EAGER_ONLY)} and has no eager attention")
        if attention_mask is None:  # plain causal
            q, k = query.shape[2], key.shape[2]
            attention_mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)[None, None]
        if attention_mask.dtype == torch.bool:  # eager attention adds its mask, as transformers' eager_mask gives it
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attention_mask = zero.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, _mask)


# ------------------------------------------------------------------------------------------ layers


def causal_lm(model: nn.Module) -> Any:
    """The transformers model under a PEFT wrapper (or the model itself). Typed `Any`: torch types a
    module's attributes as `Tensor | Module`, and transformers' methods vary by family."""
    get_base: Any = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: the module list of the model's own no-split classes (`layers`, `h`, `blocks`...)."""
    lm = causal_lm(model)
    blocks = set(getattr(lm, "_no_split_modules", None) or ())
    n = getattr(lm.config, "num_hidden_layers", None)
    lists = [m for m in lm.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for want_n in (True, False):
        for layers in lists:
            if all(type(x).__name__ in blocks for x in layers) and (not want_n or len(layers) == n):
                return layers
    for layers in lists:  # no no-split classes declared: a list named like decoder layers
        if len(layers) == n:
            return layers
    raise UnsupportedModel(f"no decoder layers found in {type(lm).__name__}")


# ------------------------------------------------------------------------------------------ loss


class _DecoderOnce(nn.Module):
    """Stands in for the model's decoder while its forward runs the head piece by piece: the first call runs
    the decoder, every call returns its output with the hidden states cut to the current piece."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder
        self.output = None
        self.piece = slice(None)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["decoder"], name)  # the head reads the decoder's attributes (multipliers)

    def forward(self, *args, **kwargs):
        first = self.output is None
        if first:
            self.output = self.decoder(*args, **kwargs)
        out = dataclasses.replace(self.output, last_hidden_state=self.output.last_hidden_state[:, self.piece])
        if not first and getattr(out, "router_logits", None) is not None:
            out.router_logits = None  # the router's aux loss once, with the first piece
        return out


def _decoder_slot(lm: Any) -> tuple[nn.Module, str]:
    """(parent module, attribute) holding the model's decoder (`model`, `transformer`, `model.decoder`...)."""
    decoder = lm.get_decoder()
    for parent in lm.modules():
        for name, m in parent.named_children():
            if m is decoder:
                return parent, name
    raise UnsupportedModel(f"{type(lm).__name__}: its decoder is not one of its modules")


def model_loss(model: nn.Module, labels: torch.Tensor, loss_chunk: int = 0, n_targets: torch.Tensor | None = None,
               **forward: object) -> torch.Tensor:
    """Cross-entropy of the model's own logits (its forward: head, scaling, softcapping) plus its aux loss.

    The decoder runs once; the head runs through the model's forward on `loss_chunk` tokens at a
    time (all at once with 0), so that a recompute rewrite keeps one piece's logits alive at a time.
    Returns the mean over targets, or the sum over `n_targets` (the walk's chunks).
    """
    lm = causal_lm(model)
    n = labels.shape[1]
    step = loss_chunk if 0 < loss_chunk < n else n
    parent, name = _decoder_slot(lm)
    decoder = parent._modules[name]
    assert decoder is not None
    once = _DecoderOnce(decoder)
    parent._modules[name] = once
    try:
        total: torch.Tensor | int = 0
        aux = None
        for i in range(0, n, step):
            once.piece = slice(i, i + step) if step < n else slice(None)
            out = lm(**forward)
            if i == 0:
                aux = getattr(out, "aux_loss", None)
            ce = F.cross_entropy(out.logits.flatten(0, 1).float(), labels[:, once.piece].flatten(), ignore_index=-100,
                                 reduction="sum" if (step < n or n_targets is not None) else "mean")
            total = total + ce
    finally:
        parent._modules[name] = once.decoder
    if step < n or n_targets is not None:
        total = total / (n_targets if n_targets is not None else (labels != -100).sum())
    if aux is not None and not isinstance(aux, (int, float)):
        total = total + lm.router_aux_loss_coef * aux
    assert isinstance(total, torch.Tensor)  # at least one piece: n >= 1
    return total


def mark_layer_outputs(model: nn.Module, prefix: str = LAYER_MARK) -> list:
    """Mark each decoder layer's output hidden state `{prefix}.{i}`; returns the hook handles."""

    def hook(i: int):
        def fn(module, args, output):
            if isinstance(output, (tuple, list)):  # some layers return a list (openai-gpt)
                return type(output)((mark(output[0], f"{prefix}.{i}"), *output[1:]))
            return mark(output, f"{prefix}.{i}")

        return fn

    return [layer.register_forward_hook(hook(i)) for i, layer in enumerate(decoder_layers(model))]


def prepare(model: nn.Module) -> None:
    """Once per model: mark the layer outputs, select remat's attention and masks, and traceable experts.

    A model whose attention cannot be selected (no attention at all: Mamba; or its own attention
    only) keeps the attention it has.
    """
    lm = causal_lm(model)
    if getattr(lm, "_remat_prepared", False):
        return
    mark_layer_outputs(lm)
    try:
        lm.set_attn_implementation(ATTENTION)
    except ValueError as e:  # transformers: "... does not support an attention implementation through ..."
        if "attention" not in str(e):
            raise
    if lm._can_set_experts_implementation():
        lm.set_experts_implementation(EXPERTS)
    lm._remat_prepared = True


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   loss_chunk: int = 0) -> torch.Tensor:
    """The model's loss on the next-token `labels` (already shifted; -100 ignored): the mean cross-entropy of
    its own logits over the targets, plus its router aux loss when it adds one."""
    prepare(model)
    with _one_sequence_per_row():
        return model_loss(model, labels, loss_chunk, input_ids=input_ids, use_cache=False)


@contextlib.contextmanager
def _one_sequence_per_row():
    """Without a cache, transformers looks for packed sequences in the position ids (0..n-1 per row, made by the
    model here: remat passes none) by reading their values. Eager reads "not packed" and masks plain causal;
    under tracing it cannot read them and assumes packing, a mask that is the same function but runs another
    SDPA kernel. remat's rows are one sequence each, so the answer is eager's."""
    saved = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


# ------------------------------------------------------------------------------------------ walk cache


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
                                   f"{' '.join(str(e).split())[:160]})") from None
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
