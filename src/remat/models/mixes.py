"""The type llama.cpp's quantizer gives each tensor for a file type ("q4_k_m"): what a plan sizes a preset at.

Read from llama.cpp's `src/llama-quant.cpp` (`tensor_allows_quantization`, `llama_tensor_get_type_impl`,
`tensor_type_fallback`), for the file types whose every tensor type remat keeps in blocks (`MIXES`): which
tensors are quantized at all (weights of two or more dimensions, norms and a few small ones aside), the tied
or output head at Q6_K (Q8_0 where its rows do not fill K blocks), more bits for some layers' attn_v and
ffn_down in the _M mixes (`more_bits`), and the fallbacks for rows a type's blocks cannot fill (a K-type on a
row of 576: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, else F16). Left out: the 70B-only and falcon-only
rules, and the importance-matrix variants.
"""

from __future__ import annotations

import re
from typing import Any

import gguf
from torch import nn

from remat.models import gguf_file
from remat.models.lora_gguf import CONVERTERS

Q = gguf.GGMLQuantizationType

# file type -> its default tensor type (llama_ftype_get_default_type)
MIXES: dict[str, Q] = {
    "f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1, "q4_k_s": Q.Q4_K, "q4_k_m": Q.Q4_K, "q5_k_s": Q.Q5_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K,
}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "shortconv.conv.weight", "altup", "laurel",
                  "per_layer_model_proj", "attn_rel_b.weight", "time_mix_")
_ATTN_V = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")
_LAYER = re.compile(r"blk\.(\d+)\.")


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _quantized(gguf_name: str, ndim: int) -> bool:
    return ndim >= 2 and gguf_name.endswith("weight") and not any(part in gguf_name for part in _NOT_QUANTIZED)


def _arch(model: nn.Module) -> str:
    converter = CONVERTERS.get(type(model).__name__)
    arch = gguf.MODEL_ARCH_NAMES[converter[0]] if converter else getattr(model.config, "model_type", "")
    if arch not in gguf.MODEL_ARCH_NAMES.values():
        raise ValueError(f"llama.cpp has no GGUF architecture for {type(model).__name__}")
    return arch


def types(model: nn.Module, mix: str) -> dict[str, int]:
    """The model's parameter name -> the type llama.cpp's quantizer gives it for `mix`, and a loaded GGUF of that
    mix holds in blocks (`gguf_file.kept_type`); parameters left out stay float32."""
    default = MIXES[mix]
    if default == Q.F32:
        return {}
    arch = _arch(model)
    gguf_names = {hf: g for g, hf in gguf_file.names(model, arch).items()}
    config: Any = model.config
    n_layers = config.num_hidden_layers
    experts = max(1, getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    attn_v = sorted((_layer(g), g) for g in gguf_names.values() if g.endswith(_ATTN_V))
    v_index = {g: i for i, (_, g) in enumerate(attn_v)}
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        g = gguf_names.get(name, name)
        if not _quantized(g, p.dim()):
            continue
        qtype: Q = default
        if default not in (Q.F16, Q.BF16):  # llama.cpp picks by category for quantized file types only
            qtype = _by_category(g, mix, default, p.shape[-1], tied, experts, n_layers, v_index.get(g, 0), len(attn_v))
            qtype = _fallback(qtype, p.shape[-1])
        kept = gguf_file.kept_type(arch, gguf_file.Tensor(g, qtype, tuple(p.shape)), tuple(p.shape))
        if kept is not None:
            out[name] = kept
    return out


def _layer(gguf_name: str) -> int:
    m = _LAYER.search(gguf_name)
    return int(m[1]) if m else -1


def _by_category(g: str, mix: str, default: Q, row: int, tied: bool, experts: int, n_layers: int,
                 i_v: int, n_v: int) -> Q:
    """llama_tensor_get_type_impl for the mixes of `MIXES`."""
    if g == "output.weight" or (tied and g == "token_embd.weight"):
        block = gguf.GGML_QUANT_SIZES[default][0]
        return Q.Q8_0 if row % block or default == Q.Q8_0 else Q.Q6_K
    if g.endswith(_ATTN_V):
        qtype: Q = default
        if mix in ("q4_k_m", "q5_k_m") and more_bits(i_v, n_v):
            qtype = Q.Q6_K
        elif mix == "q4_k_s" and i_v < 4:
            qtype = Q.Q5_K
        return Q.Q8_0 if experts == 8 else qtype
    if "attn_k.weight" in g and experts == 8:
        return Q.Q8_0
    if "ffn_down" in g:
        i = _layer(g)
        if mix in ("q4_k_m", "q5_k_m") and more_bits(i, n_layers):
            return Q.Q6_K
        if mix == "q4_k_s" and i < n_layers // 8:
            return Q.Q5_K
    if "attn_output.weight" in g and experts == 8 and mix in ("q4_k_s", "q4_k_m"):
        return Q.Q5_K
    return default


def _fallback(qtype: Q, row: int) -> Q:
    """tensor_type_fallback: a type whose blocks the row cannot fill falls back to one of 32, else F16."""
    if row % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, Q.F16)
    return qtype if row % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16
