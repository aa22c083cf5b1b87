"""Everything transformers-specific: attention and masks for tracing, layer marks, the loss.

The rest of remat sees a causal LM only through these functions: `prepare` (once per
model), `causal_lm_loss` / `model_loss` (the step's loss), `decoder_layers`, and the
`hf_cache.WalkCache` that attention and recurrent layers call on the walk path.

Follow the model, don't replace it: masks are transformers' own (`sdpa_mask` with the
model's mask function: causal, sliding window, chunked; `eager_mask` for a model that ships
eager attention only), attention is SDPA or, where a
layer needs what SDPA lacks (softcapping, sinks), the model's own eager attention; the
loss reads the logits the model's own forward makes (its head, scaling and softcapping)
and adds the router loss the model adds. What remat cannot follow it refuses, naming
the feature (`UnsupportedModel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, eager_mask, sdpa_mask

from remat.core import attention
from remat.core.cross_entropy import cross_entropy
from remat.core.marks import LAYER_MARK, mark

ATTENTION = "remat"
ATTENTION_CUDA = "remat_cuda"  # the same, for a step that runs on CUDA: the SDPA kernel chosen by remat
CUDA = torch.device("cuda")
# The same attention, with masks as transformers makes them for eager attention (float, 0 or the dtype's min), for
# a model that ships eager attention only: its code may extend or add to its mask as such (DeepSeek-V4 concatenates
# its compressors' causal bias onto it), where remat's boolean SDPA masks would be read wrongly.
ATTENTION_EAGER_MASKS = "remat_eager_masks"
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


def _attention_on_cuda(module, query, key, value, attention_mask, **kwargs):
    """remat's attention for a step that runs on CUDA: SDPA by the kernel remat chooses for CUDA, whatever device
    the (fake) tensors are on, so the step planned without a GPU holds the op the GPU runs (`core.attention`)."""
    with attention.routed(CUDA):
        return _attention(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, _mask)
AttentionInterface.register(ATTENTION_CUDA, _attention_on_cuda)
AttentionMaskInterface.register(ATTENTION_CUDA, _mask)
AttentionInterface.register(ATTENTION_EAGER_MASKS, _attention)
AttentionMaskInterface.register(ATTENTION_EAGER_MASKS, eager_mask)


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
        out = dataclasses.replace(self.output, last_hidden_state=_cut(self.output.last_hidden_state, self.piece))
        if not first and getattr(out, "router_logits", None) is not None:
            out.router_logits = None  # the router's aux loss once, with the first piece
        return out


def _cut(hidden: torch.Tensor, piece: slice) -> torch.Tensor:
    """The hidden states of one piece, laid out as a tensor of their own. A slice keeps the window's stride
    between batch rows, and `matmul` then runs the head as a batched product (`bmm`, the weight transposed) rather
    than folding it into one `mm`, as it does for the whole window: the same values, bitwise, but on a CPU in
    bfloat16 2.5x (SmolLM2's head, 256 tokens) to 25x (qwen3.5-0.8b's, 32 tokens: 2.0 s against 0.08) the time."""
    if piece == slice(None):
        return hidden
    return hidden[:, piece].clone(memory_format=torch.contiguous_format)  # a slice of one row is "contiguous"


def decoder_of(model: nn.Module) -> Any:
    """The model's decoder (the module whose output is the last hidden state): transformers' `get_decoder()`, or
    the base model where what that finds holds no decoder layers (it looks for an attribute named `decoder` first,
    and ModernBERT-decoder's output projection is named so)."""
    lm = causal_lm(model)
    decoder = lm.get_decoder()
    layers = decoder_layers(lm)
    return decoder if any(m is layers for m in decoder.modules()) else lm.base_model


def _decoder_slot(lm: Any) -> tuple[nn.Module, str]:
    """(parent module, attribute) holding the model's decoder (`model`, `transformer`, `model.decoder`...)."""
    decoder = decoder_of(lm)
    for parent in lm.modules():
        for name, m in parent.named_children():
            if m is decoder:
                return parent, name
    raise UnsupportedModel(f"{type(lm).__name__}: its decoder is not one of its modules")


# The bytes of one loss piece's logits in fp32 that the default chunk stays within: SmolLM2's 256 tokens of its
# 49,152-token vocabulary. The logits of one piece, their log-softmax and their gradient are the head's floor
# once recompute keeps one piece at a time (qwen3.5-0.8b's 248,320-token vocabulary at 256 tokens: 752 MiB of
# plan at ctx 256; at 32 tokens, 117).
LOSS_PIECE_BYTES = 48 << 20
LOSS_CHUNK_RANGE = (16, 256)  # fewer tokens make the head's matmuls too small; more save no time worth the bytes


def loss_chunk_for(config: Any, walk: bool = False) -> int:
    """The default tokens per loss piece for a model: the largest power of two whose fp32 logits (tokens x
    vocabulary x 4 bytes) fit LOSS_PIECE_BYTES, within LOSS_CHUNK_RANGE; on the walk, a quarter of those bytes
    (a chunk's step holds one chunk's activations, and three logits-sized tensors of a piece would be most of it:
    SmolLM2 64 tokens). A function of the model's shape alone (not of free memory), so a job gives the same losses
    on every machine. The hidden size does not enter: every piece reads the whole head (vocabulary x hidden)
    whatever its length, and holds tokens x vocabulary."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fits = max(1, LOSS_PIECE_BYTES // (4 if walk else 1) // (4 * int(text.vocab_size)))
    low, high = LOSS_CHUNK_RANGE
    return max(low, min(high, 1 << (fits.bit_length() - 1)))


_only_pieces: list[list[int]] = []  # while `traced_pieces` is on: the loss pieces that run (the rest are stamped)


@contextlib.contextmanager
def traced_pieces(pieces: list[int]):
    """While tracing a step to stamp its loss head (`remat.fastplan.pieces`): only these pieces of the loss run."""
    _only_pieces.append(pieces)
    try:
        yield
    finally:
        _only_pieces.pop()


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
        starts = range(0, n, step)
        for i in [starts[k] for k in _only_pieces[-1]] if _only_pieces else starts:
            once.piece = slice(i, i + step) if step < n else slice(None)
            out = lm(**forward)
            if i == 0:
                aux = getattr(out, "aux_loss", None)
            ce = cross_entropy(out.logits.flatten(0, 1), labels[:, once.piece].flatten(),
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


class _Mark:
    """A forward hook marking a decoder layer's output hidden state (`remat::mark`). The first layer's also keeps
    what `prepare` changed on the model, for `unprepare`."""

    def __init__(self, name: str, before: tuple[str | None, str | None] | None = None):
        self.name, self.before = name, before

    def __call__(self, module: nn.Module, args: object, output: Any) -> Any:
        if isinstance(output, (tuple, list)):  # some layers return a list (openai-gpt)
            return type(output)((mark(output[0], self.name), *output[1:]))
        return mark(output, self.name)


def _marks(layer: nn.Module) -> list[tuple[int, _Mark]]:
    return [(k, h) for k, h in layer._forward_hooks.items() if isinstance(h, _Mark)]


def prepare(model: nn.Module, device: torch.device | None = None) -> None:
    """Ready a model for tracing (idempotent): mark its decoder layers' outputs `l_out.{i}` (forward hooks),
    select remat's attention and masks, and traceable experts. `unprepare` undoes it.

    `device` is where the step runs (default: where the model is, or, prepared already, as it was): on CUDA,
    remat's attention runs the SDPA kernel remat chooses (`ATTENTION_CUDA`), whatever device the tensors traced
    are on. A model that ships
    without SDPA gets its masks in eager attention's format (`ATTENTION_EAGER_MASKS`). A model whose attention
    cannot be selected (no attention at all: Mamba; or its own attention only) keeps the attention it has.
    """
    lm = causal_lm(model)
    layers = decoder_layers(lm)
    on_cuda = (device or next(lm.parameters()).device).type == "cuda"
    wanted = (ATTENTION_CUDA if on_cuda else ATTENTION) if lm._supports_sdpa else ATTENTION_EAGER_MASKS
    if _marks(layers[0]):
        held = lm.config._attn_implementation
        if device is not None and held in (ATTENTION, ATTENTION_CUDA) and held != wanted:  # for another device
            lm.set_attn_implementation(wanted)
        return
    before = (lm.config._attn_implementation, getattr(lm.config, "_experts_implementation", None))
    for i, layer in enumerate(layers):
        layer.register_forward_hook(_Mark(f"{LAYER_MARK}.{i}", before if i == 0 else None))
    try:
        lm.set_attn_implementation(wanted)
    except ValueError as e:  # transformers: "... does not support an attention implementation through ..."
        if "attention" not in str(e):
            raise
    if lm._can_set_experts_implementation():
        lm.set_experts_implementation(EXPERTS)


def unprepare(model: nn.Module) -> None:
    """Undo `prepare`: remove the marks and give the model back the attention and experts it had."""
    lm = causal_lm(model)
    layers = decoder_layers(lm)
    marks = _marks(layers[0])
    if not marks:
        return
    attn, experts = marks[0][1].before or (None, None)
    for layer in layers:
        for k, _ in _marks(layer):
            del layer._forward_hooks[k]
    if attn is not None and attn != lm.config._attn_implementation:
        lm.set_attn_implementation(attn)
    if experts is not None and lm._can_set_experts_implementation():
        lm.set_experts_implementation(experts)


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


@contextlib.contextmanager
def only_layers(model: nn.Module, layers: nn.ModuleList, keep: tuple[int, ...]) -> Iterator[None]:
    """The decoder runs only the layers `keep` (the model iterates over its layer list; slices of it by the
    configured depth stop at the list's end), and its config's per-layer lists (`layer_types`: LFM3 picks each
    layer's mask and rotary tables by its place in the list) are cut to match."""
    saved = dict(layers._modules)
    n, keys = len(saved), list(saved)
    configs = {id(c): c for m in causal_lm(model).modules() if (c := getattr(m, "config", None)) is not None}
    lists = [(c, k, v) for c in configs.values() for k, v in vars(c).items()
             if isinstance(v, (list, tuple)) and len(v) == n]
    layers._modules = {keys[i]: saved[keys[i]] for i in keep}
    for c, k, v in lists:
        setattr(c, k, type(v)(v[i] for i in keep))
    try:
        yield
    finally:
        layers._modules = saved
        for c, k, v in lists:
            setattr(c, k, v)
