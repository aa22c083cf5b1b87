"""Everything transformers-specific: attention and masks for tracing, layer marks, the loss head, the walk's cache.

The rest of remat sees a causal LM only through these functions: `prepare` (once per
model), `causal_lm_loss` / `head_loss` (the step's loss), `decoder_layers`, and the
`WalkCache` that attention and recurrent layers call on the walk path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from remat.marks import mark

ATTENTION = "remat"
LAYER_MARK = "l_out"  # each decoder layer's output (the residual stream) is marked `l_out.{i}`


# ------------------------------------------------------------------------------------------ attention


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0, device=None, **kwargs):
    """No mask for a plain causal window; for a chunk attending over a cache, keys up to each query."""
    if isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and kv_length == q_length:
        return None
    q = q_offset + torch.arange(q_length, device=device)
    kv = kv_offset + torch.arange(kv_length, device=device)
    return (kv[None, :] <= q[:, None])[None, None]


def _attention(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# SDPA with masks remat builds. transformers' own "sdpa" decides between a mask and
# `is_causal` with data-dependent checks that answer differently under tracing than in
# eager mode, so a traced step would not match eager; these have no such branch.
AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, _mask)


# ------------------------------------------------------------------------------------------ layers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (PEFT-wrapped or not)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and module is not model:
            return layers
    raise ValueError(f"no decoder layers found in {type(model).__name__}")


def mark_layer_outputs(model: nn.Module, prefix: str = LAYER_MARK) -> list:
    """Mark each decoder layer's output hidden state `{prefix}.{i}`; returns the hook handles."""

    def hook(i: int):
        def fn(module, args, output):
            if isinstance(output, tuple):
                return (mark(output[0], f"{prefix}.{i}"), *output[1:])
            return mark(output, f"{prefix}.{i}")

        return fn

    return [layer.register_forward_hook(hook(i)) for i, layer in enumerate(decoder_layers(model))]


def prepare(model: nn.Module) -> None:
    """Mark the layer outputs and select remat's attention masks, once per model."""
    if not getattr(model, "_remat_prepared", False):
        mark_layer_outputs(model)
        model.set_attn_implementation(ATTENTION)
        model._remat_prepared = True


# ------------------------------------------------------------------------------------------ loss


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   loss_chunk: int = 0) -> torch.Tensor:
    """Token-weighted mean cross-entropy over targets (labels == -100 are ignored)."""
    prepare(model)
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    return head_loss(model, hidden, labels, loss_chunk)


def head_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, loss_chunk: int = 0,
              n_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of the LM head over `hidden`: the mean over targets, or the sum over `n_targets`.

    With `loss_chunk` = N > 0 the head runs on N tokens at a time: each chunk's logits
    and cross-entropy are separate nodes, summed and divided by the number of targets,
    so a recompute rewrite can keep one chunk's logits alive at a time.
    """
    head = model.get_output_embeddings()
    n = hidden.shape[1]
    if n_targets is None and not 0 < loss_chunk < n:
        return F.cross_entropy(head(hidden).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    step = loss_chunk if 0 < loss_chunk < n else n
    total = sum(
        F.cross_entropy(head(hidden[:, i:i + step]).flatten(0, 1).float(),
                        labels[:, i:i + step].flatten(), ignore_index=-100, reduction="sum")
        for i in range(0, n, step)
    )
    return total / (n_targets if n_targets is not None else (labels != -100).sum())


# ------------------------------------------------------------------------------------------ walk cache


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
