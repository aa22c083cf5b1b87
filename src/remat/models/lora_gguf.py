"""A LoRA adapter as llama.cpp takes it (`adapter.gguf`, `llama-server --lora`): each adapted linear layer's A and B
under llama.cpp's tensor names, with the row reorders its converter applies to the base (`convert_hf_to_gguf.py`:
Q/K permutation, fused QKV, Qwen3.5's value heads), checked against the base GGUF's shapes where it is at hand.
Families and layers llama.cpp cannot take are named (`NoGGUF`, notes), never written wrong."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from torch import nn

from remat.base.files import staged_file
from remat.base.settings import AdapterError

if TYPE_CHECKING:  # peft takes a second to import: only LoRA pays for it
    import peft

GGUF_NAME = "adapter.gguf"


_A = gguf.MODEL_ARCH


class NoGGUF(AdapterError):
    """llama.cpp cannot take this adapter (family, layout or targets): the PEFT files are still written."""


def _permute_qk(name: str, a: np.ndarray, b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    # LlamaModel.modify_tensors: HF's rotate-half Q/K rows -> llama.cpp's interleaved RoPE pairs.
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    for suffix, heads in (("q_proj", n_head), ("k_proj", n_kv)):
        if name.endswith(suffix):  # LlamaModel.permute; reordering W's rows moves B's rows
            b = b.reshape(heads, 2, b.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(b.shape)
    return a, b


def _heads_qkv(name: str, a: np.ndarray, b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    # BloomModel / GPTNeoXModel.modify_tensors: fused rows per head [q, k, v] -> [all q, all k, all v].
    if name.endswith("query_key_value"):
        b = b.reshape(config.num_attention_heads, 3, -1, b.shape[1]).swapaxes(0, 1).reshape(b.shape)
    return a, b


def _falcon_qkv(name: str, a: np.ndarray, b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    # FalconModel.modify_tensors: kv groups [q.. k v] -> [all q, all k, all v], with the converter's head counts.
    if not name.endswith("query_key_value"):
        return a, b
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_kv_heads", None) or 1
    head_dim = config.hidden_size // n_head
    if b.shape[0] != n_kv * (n_head // n_kv + 2) * head_dim:  # the converter's view() fails on this base too
        raise NoGGUF(f"llama.cpp's converter cannot regroup this Falcon query_key_value ({n_kv} kv heads, "
                      f"{b.shape[0]} rows)")
    groups = b.reshape(n_kv, n_head // n_kv + 2, head_dim, b.shape[1])
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return a, np.concatenate([t.reshape(-1, b.shape[1]) for t in (q, k, v)])


def reorder_v_heads(w: np.ndarray, dim: int, n_k: int, v_per_k: int, head_dim: int) -> np.ndarray:
    # convert_hf_to_gguf.py _LinearAttentionVReorderBase.reorder_v_heads: V heads grouped by K head
    # [K0v0, K0v1, K1v0, K1v1] -> tiled [K0v0, K1v0, K0v1, K1v1] along `dim`.
    shape = w.shape
    return w.reshape(*shape[:dim], n_k, v_per_k, head_dim, *shape[dim + 1:]).swapaxes(dim, dim + 1).reshape(shape)


def _qwen35_v(name: str, a: np.ndarray, b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    # _LinearAttentionVReorderBase.modify_tensors: V heads of the linear attention to tiled order.
    n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
    if ".linear_attn." not in name or n_k == n_v:  # the converter reorders only then
        return a, b
    v_per_k, dk, dv = n_v // n_k, config.linear_key_head_dim, config.linear_value_head_dim
    if name.endswith("in_proj_qkv"):
        qk = 2 * n_k * dk  # only the V rows move
        b = np.concatenate([b[:qk], reorder_v_heads(b[qk:], 0, n_k, v_per_k, dv)])
    elif name.endswith("in_proj_z"):
        b = reorder_v_heads(b, 0, n_k, v_per_k, dv)
    elif name.endswith(("in_proj_a", "in_proj_b")):
        b = reorder_v_heads(b, 0, n_k, v_per_k, 1)
    elif name.endswith("out_proj"):  # reordering W's columns moves A's columns
        a = reorder_v_heads(a, 1, n_k, v_per_k, dv)
    return a, b


def _glm4(name: str, a: np.ndarray, b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    # Glm4Model.modify_tensors permutes Q/K to NeoX order only for M-RoPE (the vision variant).
    if "mrope_section" in (getattr(config, "rope_parameters", None) or {}):
        raise NoGGUF("llama.cpp reorders GLM-4's Q/K rows for M-RoPE; that reorder is not reproduced")
    return a, b


Layout = Callable[[str, np.ndarray, np.ndarray, Any], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class _Rule:
    """What one converter class of llama.cpp does to the linear weights a LoRA targets."""

    layout: Layout | None = None  # the row/column reorder, applied to the LoRA pair; None: none
    left_out: tuple[tuple[str, str], ...] = ()  # (module name suffix, why a LoRA pair cannot follow the converter)
    refused: str = ""  # why the family gets no adapter.gguf at all


_PLAIN, _LLAMA = _Rule(), _Rule(_permute_qk)
# MLA (DeepseekV2Model and subclasses, KimiLinearModel): kv_b_proj becomes two tensors, one transposed per head.
_MLA = _Rule(left_out=(("kv_b_proj", "llama.cpp splits it per head into k_b (transposed) and v_b"),))

# HF causal-LM class -> (llama.cpp architecture, what its converter does to LoRA-targeted weights). The keys are the
# classes ggml-org/llama.cpp's convert_hf_to_gguf.py registers (@ModelBase.register: it dispatches on config.json's
# "architectures", i.e. the class name transformers saves), read at commit 0024aa7 for each class's modify_tensors.
CONVERTERS: dict[str, tuple[gguf.MODEL_ARCH, _Rule]] = {
    "LlamaForCausalLM": (_A.LLAMA, _LLAMA), "MistralForCausalLM": (_A.LLAMA, _LLAMA),
    "MixtralForCausalLM": (_A.LLAMA, _LLAMA), "ArceeForCausalLM": (_A.ARCEE, _LLAMA),
    "SmolLM3ForCausalLM": (_A.SMOLLM3, _LLAMA), "Ministral3ForCausalLM": (_A.MISTRAL3, _LLAMA),
    "GraniteForCausalLM": (_A.GRANITE, _LLAMA), "GraniteMoeForCausalLM": (_A.GRANITE_MOE, _LLAMA),
    "GraniteMoeSharedForCausalLM": (_A.GRANITE_MOE, _LLAMA), "BambaForCausalLM": (_A.GRANITE_HYBRID, _LLAMA),
    "GraniteMoeHybridForCausalLM": (_A.GRANITE_HYBRID, _Rule(_permute_qk, (
        ("shared_mlp.input_linear", "llama.cpp splits it into the gate and up projections"),))),
    "OlmoForCausalLM": (_A.OLMO, _LLAMA),
    # LlamaModel subclasses that opt out of the permutation (undo_permute = False, or ModelBase.modify_tensors)
    "AfmoeForCausalLM": (_A.AFMOE, _PLAIN), "ApertusForCausalLM": (_A.APERTUS, _PLAIN),
    "Llama4ForCausalLM": (_A.LLAMA4, _PLAIN),
    "BloomForCausalLM": (_A.BLOOM, _Rule(_heads_qkv)), "GPTNeoXForCausalLM": (_A.GPTNEOX, _Rule(_heads_qkv)),
    "FalconForCausalLM": (_A.FALCON, _Rule(_falcon_qkv)),
    "Qwen3_5ForCausalLM": (_A.QWEN35, _Rule(_qwen35_v)), "Qwen3_5MoeForCausalLM": (_A.QWEN35MOE, _Rule(_qwen35_v)),
    "Qwen3NextForCausalLM": (_A.QWEN3NEXT, _Rule(left_out=(
        ("in_proj_qkvz", "llama.cpp regroups it by head and splits it into attn_qkv and attn_gate"),))),
    "DeepseekV2ForCausalLM": (_A.DEEPSEEK2, _MLA), "DeepseekV3ForCausalLM": (_A.DEEPSEEK2, _MLA),
    "YoutuForCausalLM": (_A.DEEPSEEK2, _MLA), "Glm4MoeLiteForCausalLM": (_A.DEEPSEEK2, _MLA),
    "GlmMoeDsaForCausalLM": (_A.GLM_DSA, _MLA), "KimiLinearForCausalLM": (_A.KIMI_LINEAR, _MLA),
    "Glm4ForCausalLM": (_A.GLM4, _Rule(_glm4)),
    "FalconH1ForCausalLM": (_A.FALCON_H1, _Rule(refused="llama.cpp folds its multipliers into the weights")),
    "Gemma3nForCausalLM": (_A.GEMMA3N, _Rule(refused="llama.cpp converts only the multimodal checkpoint")),
    # Converters that leave the targeted linear weights as they are.
    **{cls: (arch, _PLAIN) for cls, arch in {
        "Qwen2ForCausalLM": _A.QWEN2, "Qwen2MoeForCausalLM": _A.QWEN2MOE, "Qwen3ForCausalLM": _A.QWEN3,
        "Qwen3MoeForCausalLM": _A.QWEN3MOE, "GPT2LMHeadModel": _A.GPT2,  # Conv1D: PEFT's B·A is already [out, in]
        "GPTBigCodeForCausalLM": _A.STARCODER, "Starcoder2ForCausalLM": _A.STARCODER2,
        "StableLmForCausalLM": _A.STABLELM, "PhiForCausalLM": _A.PHI2, "Phi3ForCausalLM": _A.PHI3,
        "GemmaForCausalLM": _A.GEMMA, "Gemma2ForCausalLM": _A.GEMMA2, "Gemma3ForCausalLM": _A.GEMMA3,
        "MambaForCausalLM": _A.MAMBA, "FalconMambaForCausalLM": _A.MAMBA, "Mamba2ForCausalLM": _A.MAMBA2,
        "JambaForCausalLM": _A.JAMBA, "CohereForCausalLM": _A.COMMAND_R, "Cohere2ForCausalLM": _A.COHERE2,
        "Olmo2ForCausalLM": _A.OLMO2, "Olmo3ForCausalLM": _A.OLMO2, "OlmoeForCausalLM": _A.OLMOE,
        "SeedOssForCausalLM": _A.SEED_OSS, "MiniCPM3ForCausalLM": _A.MINICPM3, "Ernie4_5ForCausalLM": _A.ERNIE4_5,
        "Ernie4_5_MoeForCausalLM": _A.ERNIE4_5_MOE, "Dots1ForCausalLM": _A.DOTS1, "Jais2ForCausalLM": _A.JAIS2,
        "Glm4MoeForCausalLM": _A.GLM4_MOE, "SolarOpenForCausalLM": _A.GLM4_MOE, "GlmForCausalLM": _A.CHATGLM,
        "NemotronForCausalLM": _A.NEMOTRON, "NemotronHForCausalLM": _A.NEMOTRON_H, "Exaone4ForCausalLM": _A.EXAONE4,
        "HunYuanDenseV1ForCausalLM": _A.HUNYUAN_DENSE, "HunYuanMoEV1ForCausalLM": _A.HUNYUAN_MOE,
        "MiniMaxM2ForCausalLM": _A.MINIMAXM2, "MiMoV2FlashForCausalLM": _A.MIMO2, "GptOssForCausalLM": _A.GPT_OSS,
        "Lfm2ForCausalLM": _A.LFM2, "Lfm2MoeForCausalLM": _A.LFM2MOE,
        # transformers spells these classes differently from the hub checkpoints llama.cpp registers
        # (PhiMoEForCausalLM, ExaoneMoEForCausalLM, MPTForCausalLM): the same converters.
        "PhimoeForCausalLM": _A.PHIMOE, "ExaoneMoeForCausalLM": _A.EXAONE_MOE, "MptForCausalLM": _A.MPT,
    }.items()},
}


def _gguf_plan(model: nn.Module) -> tuple[gguf.MODEL_ARCH, _Rule]:
    """The llama.cpp architecture of `model` (an HF causal LM) and its converter's rule; NoGGUF when none."""
    cls, family = type(model).__name__, getattr(model.config, "model_type", "?")
    arch, rule = CONVERTERS.get(cls, (None, _PLAIN))
    if arch is None:
        raise NoGGUF(f"GGUF adapter export is not supported for {family}: llama.cpp's converter has no {cls}")
    if rule.refused:
        raise NoGGUF(f"GGUF adapter export is not supported for {family}: {rule.refused}")
    return arch, rule


_PARAMETER_LORA = "PEFT adapts the parameter itself (MoE experts, routers); only linear layers are written"


def _lora_pairs(model: peft.PeftModel) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor] | None]]:
    """(module name in the HF model, (A [r, in], B [out, r])) for each adapted layer; for a LoRA on a
    parameter (PEFT's target_parameters, which "all-linear" adds for fused MoE experts), (its name, None)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper
    adapter = model.active_adapter
    config: Any = model.peft_config[adapter]  # a LoraConfig (PEFT types it as the base PeftConfig)
    if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False) or config.bias != "none":
        raise AdapterError("GGUF adapter export supports plain LoRA only (no DoRA, no bias)")
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if isinstance(module, ParamWrapper):  # nested wrappers: ...experts.base_layer for a second parameter
            yield f"{name.replace('.base_layer', '')}.{module.parameter_name}", None
            continue
        if adapter not in module.lora_B or not isinstance(module.lora_A[adapter], nn.Linear):
            raise AdapterError(f"GGUF adapter export supports LoRA on linear layers only, not '{name}'")
        r = module.r[adapter]
        # llama.cpp scales by adapter.lora.alpha / rank, one alpha for the whole file.
        if not np.isclose(module.scaling[adapter], config.lora_alpha / r, rtol=1e-6):
            raise AdapterError(f"'{name}' is scaled by {module.scaling[adapter]:g}, not lora_alpha / r: "
                               "llama.cpp cannot express that (rsLoRA or per-layer alpha)")
        lora_a: Any = module.lora_A[adapter]
        lora_b: Any = module.lora_B[adapter]
        yield name, (lora_a.weight, lora_b.weight)


def _base_tensors(path: Path, arch: gguf.MODEL_ARCH) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in ggml `ne` order, of the base GGUF; checks it is the same architecture."""
    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
        base_arch = field.contents() if field is not None else None
    except (OSError, ValueError, KeyError) as e:
        raise AdapterError(f"cannot read base GGUF '{path}': {e}") from None
    if base_arch != gguf.MODEL_ARCH_NAMES[arch]:
        raise AdapterError(f"base GGUF '{path}' is a {base_arch} model, the adapter is for "
                           f"{gguf.MODEL_ARCH_NAMES[arch]}")
    return {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def _check_base(base: dict[str, tuple[int, ...]], name: str, gguf_name: str, a: np.ndarray, b: np.ndarray) -> None:
    # llama.cpp's loader: the tensor exists in the base, W.ne = [in, out] matches a.ne[0] and b.ne[1].
    if gguf_name not in base:
        raise AdapterError(f"base GGUF has no tensor '{gguf_name}' for '{name}'")
    if base[gguf_name][:2] != (a.shape[1], b.shape[0]):
        raise AdapterError(f"'{name}' is {b.shape[0]}x{a.shape[1]}, but '{gguf_name}' in the "
                           f"base GGUF is {base[gguf_name][1]}x{base[gguf_name][0]}")


def _why_left_out(name: str, pair: object, gguf_name: str | None, arch: gguf.MODEL_ARCH,
                  rule: _Rule) -> tuple[str, str]:
    """(kind, why) of an adapted layer adapter.gguf cannot hold, or (kind, "") of one it can."""
    if pair is None:
        return ".".join(name.split(".")[-2:]), _PARAMETER_LORA
    for suffix, why in rule.left_out:
        if name.endswith(suffix):
            return suffix, why
    if gguf_name is None:
        return name.rsplit(".", 1)[-1], f"llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} models have no tensor for it"
    return name.rsplit(".", 1)[-1], ""


def _adapter_tensors(model: peft.PeftModel, arch: gguf.MODEL_ARCH, rule: _Rule,
                     base: dict[str, tuple[int, ...]] | None) -> tuple[dict[str, np.ndarray], list[str]]:
    """The GGUF tensors of the adapter, and one line per kind of layer left out (with how many and why)."""
    config: Any = model.get_base_model().config
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors: dict[str, np.ndarray] = {}
    left_out: dict[tuple[str, str], int] = {}
    for name, pair in _lora_pairs(model):
        gguf_name = name_map.get_name(name + ".weight", try_suffixes=(".weight",))
        kind, why = _why_left_out(name, pair, gguf_name, arch, rule)
        if why or gguf_name is None or pair is None:
            left_out[kind, why] = left_out.get((kind, why), 0) + 1
            continue
        a_np, b_np = (t.detach().to("cpu", torch.float32).numpy() for t in pair)
        if base is not None:
            _check_base(base, name, gguf_name, a_np, b_np)
        if rule.layout is not None:  # what the converter does to W = B·A
            a_np, b_np = rule.layout(name, a_np, b_np, config)
        tensors[gguf_name + ".lora_a"] = np.ascontiguousarray(a_np)
        tensors[gguf_name + ".lora_b"] = np.ascontiguousarray(b_np)
    notes = [f"{kind} ({n} layer{'s' * (n > 1)}): {why}" for (kind, why), n in left_out.items()]
    if not tensors:
        raise NoGGUF(f"no adapted layer can be written for llama.cpp: {'; '.join(notes) or 'no LoRA weights'}")
    return tensors, notes


def write_gguf_adapter(model: peft.PeftModel, path: Path, *, base_gguf: Path | None = None) -> list[str]:
    """Write the active adapter as a llama.cpp GGUF LoRA adapter at `path` (atomically).

    Tensors are the base GGUF tensor names + `.lora_a` [r, in] / `.lora_b` [out, r] (numpy shapes; GGUF
    stores dims reversed), float32, in the base GGUF's row order (what llama.cpp's converter does to the
    family's weights, applied to each pair). With `base_gguf`, every tensor is checked against the base the
    way llama.cpp's loader does. Returns a line for each kind of adapted layer left out of the file.
    """
    import peft
    if not isinstance(model, peft.PeftModel):
        raise AdapterError("the model has no adapter to export (it is not a PEFT model)")
    arch, rule = _gguf_plan(model.get_base_model())
    base = _base_tensors(Path(base_gguf), arch) if base_gguf is not None else None
    tensors, notes = _adapter_tensors(model, arch, rule, base)
    with staged_file(Path(path)) as tmp:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        lora_config: Any = model.peft_config[model.active_adapter]
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora_config.lora_alpha))
        for tname, t in tensors.items():
            writer.add_tensor(tname, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return notes


