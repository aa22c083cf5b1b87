"""LoRA adapters: attach them with PEFT, save them for PEFT and llama.cpp, merge them into the base.

An adapter folder holds PEFT's adapter_config.json + adapter_model.safetensors and `adapter.gguf`, the
same adapter as a llama.cpp GGUF LoRA (`llama-server --lora adapter.gguf`). PEFT's
`base_model_name_or_path` records the spec of the base model (a preset name, a path, or "default" for
the embedded model), so a merge can find the base again without being told.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import peft
import safetensors
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from remat.files import listing, staged, staged_file
from remat.models import ModelError, load_model
from remat.settings import UsageError, one_line

__all__ = [
    "DEFAULT_BASE",
    "AdapterError",
    "LoraSettings",
    "apply_lora",
    "merge_into_base",
    "save_adapter",
    "write_gguf_adapter",
]

DEFAULT_BASE = "default"  # base_model_name_or_path of an adapter trained on the embedded default model
GGUF_NAME = "adapter.gguf"


class AdapterError(UsageError):
    """An adapter that cannot be made, saved or merged; the message is one line meant for the user."""


@dataclass
class LoraSettings:
    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    targets: list[str] | None = None  # module names (or name suffixes); None: every linear layer but lm_head


# ---------------------------------------------------------------------------------------------------------
# plan, from shapes: what an adapter will take before PEFT allocates it


def linear_shapes(model: nn.Module) -> list[tuple[str, int, int]]:
    """(name, in, out) of every linear layer: real or fake weights alike, nothing is allocated."""
    return [(n, m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def state_bytes(linears: list[tuple[str, int, int]], s: LoraSettings) -> int:
    """The adapter's fp32 weights, grads and two AdamW states (16 bytes a parameter), for the layers it
    targets: those named, or every linear layer but the head."""
    def targeted(name: str) -> bool:
        if s.targets is None:
            return name.rsplit(".", 1)[-1] != "lm_head"
        return any(name == t or name.endswith("." + t) for t in s.targets)

    return 16 * sum(s.r * (i + o) for name, i, o in linears if targeted(name))


def over_budget(need: int, budget: int, s: LoraSettings, rank_option: str) -> str | None:
    """Why an adapter that needs `need` bytes cannot fit `budget` (None when it can)."""
    if need <= budget:
        return None
    return (f"a LoRA of rank {s.r} needs {need / 2**20:,.1f} MiB for its weights, grads and optimizer states "
            f"alone, over the budget of {budget / 2**20:,.1f} MiB: lower {rank_option} or target fewer layers")


# ---------------------------------------------------------------------------------------------------------
# apply


def _check_settings(model: nn.Module, s: LoraSettings) -> None:
    if isinstance(s.r, bool) or not isinstance(s.r, int) or s.r <= 0:
        raise AdapterError(f"LoRA rank r must be a positive integer, not {s.r!r}")
    if not s.alpha > 0:
        raise AdapterError(f"LoRA alpha must be positive, not {s.alpha!r}")
    if not 0 <= s.dropout < 1:
        raise AdapterError(f"LoRA dropout must be in [0, 1), not {s.dropout!r}")
    if s.targets is None:
        return
    if not s.targets:
        raise AdapterError("LoRA targets is empty: give module names, or none for all linear layers")
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    # PEFT's rule for a list of targets: the whole name, or its last dotted parts.
    unmatched = [t for t in s.targets if not any(n == t or n.endswith("." + t) for n in linear)]
    if unmatched:
        raise AdapterError(f"LoRA targets match no linear layer: {', '.join(unmatched)}")


def apply_lora(model: nn.Module, s: LoraSettings, *, seed: int = 0) -> peft.PeftModel:
    """Wrap `model` (changed in place) with a fresh LoRA adapter; only the adapter's weights train.

    The same seed gives the same initial adapter, and the caller's RNG state is left alone.
    """
    if isinstance(model, peft.PeftModel):
        raise AdapterError("the model already has an adapter")
    _check_settings(model, s)  # before PEFT touches the model, so a bad setting leaves it as it was
    config = peft.LoraConfig(
        r=s.r,
        lora_alpha=s.alpha,  # type: ignore[arg-type]  # PEFT annotates int; it scales by any number
        lora_dropout=s.dropout,
        # PEFT's "all-linear" is every linear layer except the output head.
        target_modules=list(s.targets) if s.targets is not None else "all-linear",
        bias="none",
        task_type=peft.TaskType.CAUSAL_LM,
    )
    note = ""
    if s.targets is None:  # every linear layer but the head, less those PEFT refuses for this family
        refused = _peft_refused(model)
        if refused:
            head = cast(Any, model).get_output_embeddings()
            config.target_modules = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                                            if isinstance(m, nn.Linear) and m is not head
                                            and name.rsplit(".", 1)[-1] not in refused})
            note = f"LoRA leaves out {', '.join(sorted(refused))}: PEFT does not support them for this model"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config)
    if note:
        cast(Any, wrapped)._remat_lora_note = note
    return wrapped


def _peft_refused(model: nn.Module) -> set[str]:
    """Linear layer names PEFT refuses as LoRA targets for this model (Mamba's out_proj), asked of PEFT's own check."""
    check = getattr(peft.tuners.tuners_utils, "_check_lora_target_modules_mamba", None)
    if check is None:
        return set()
    probe = peft.LoraConfig(target_modules="all-linear")
    refused = set()
    for name in {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}:
        try:
            check(probe, model, name)
        except ValueError:
            refused.add(name)
    return refused


# ---------------------------------------------------------------------------------------------------------
# files


def save_adapter(model: peft.PeftModel, out: str | Path, *, base_name: str,
                 base_gguf: Path | None = None) -> list[str]:
    """Write the adapter into the new folder `out`: PEFT files plus `adapter.gguf`; returns the files.

    base_name: the spec the base was loaded with (what `load_model` takes), or "default".
    base_gguf: the base model's GGUF file, to check the GGUF adapter against it.
    When llama.cpp's format has no mapping for the architecture, adapter.gguf is skipped with a warning.
    """
    if not isinstance(model, peft.PeftModel):
        raise AdapterError("the model has no adapter to save (it is not a PEFT model)")
    out = Path(out)
    config = model.peft_config[model.active_adapter]
    with staged(out, error=AdapterError) as tmp:
        config.base_model_name_or_path = base_name
        # "auto" would look up base_name on the Hugging Face hub; the vocabulary never changes here.
        model.save_pretrained(str(tmp), save_embedding_layers=False)
        try:
            _gguf_arch(model.get_base_model().config)
        except AdapterError as e:
            warnings.warn(f"{GGUF_NAME} not written: {e}", stacklevel=2)
        else:
            write_gguf_adapter(model, tmp / GGUF_NAME, base_gguf=base_gguf)
        files = listing(tmp, out)
    return files


# ---------------------------------------------------------------------------------------------------------
# GGUF


# HF model_type -> llama.cpp architecture, for the families whose HF -> GGUF weight conversion is known
# (see _to_gguf_layout); anything else would risk an adapter that loads but computes the wrong thing.
_GGUF_ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_5_text": gguf.MODEL_ARCH.QWEN35,
}


def _gguf_arch(config) -> gguf.MODEL_ARCH:
    arch = _GGUF_ARCHS.get(config.model_type)
    if arch is None:
        raise AdapterError(f"GGUF adapter export is not supported for {config.model_type}")
    return arch


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: HF's rotate-half rows -> llama.cpp's interleaved RoPE pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reorder_v_heads(w: np.ndarray, dim: int, n_k: int, v_per_k: int, head_dim: int) -> np.ndarray:
    # convert_hf_to_gguf.py _LinearAttentionVReorderBase._reorder_v_heads: V heads grouped by K head
    # [K0v0, K0v1, K1v0, K1v1] -> tiled [K0v0, K1v0, K0v1, K1v1] along `dim`.
    shape = w.shape
    return w.reshape(*shape[:dim], n_k, v_per_k, head_dim, *shape[dim + 1:]).swapaxes(dim, dim + 1).reshape(shape)


def _to_gguf_layout(arch: gguf.MODEL_ARCH, name: str, a: np.ndarray, b: np.ndarray,
                    config) -> tuple[np.ndarray, np.ndarray]:
    """Apply to a LoRA pair what llama.cpp's converter does to the base weight W = B·A.

    Reordering W's rows (output) moves B's rows; reordering its columns (input) moves A's columns.
    """
    if arch == gguf.MODEL_ARCH.LLAMA:
        if name.endswith("q_proj"):
            b = _llama_permute(b, config.num_attention_heads)
        elif name.endswith("k_proj"):
            b = _llama_permute(b, config.num_key_value_heads)
    elif arch == gguf.MODEL_ARCH.QWEN35 and ".linear_attn." in name:
        n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
        if n_k != n_v:  # the converter reorders only then
            v_per_k, dk, dv = n_v // n_k, config.linear_key_head_dim, config.linear_value_head_dim
            if name.endswith("in_proj_qkv"):
                qk = 2 * n_k * dk  # only the V rows move
                b = np.concatenate([b[:qk], _reorder_v_heads(b[qk:], 0, n_k, v_per_k, dv)])
            elif name.endswith("in_proj_z"):
                b = _reorder_v_heads(b, 0, n_k, v_per_k, dv)
            elif name.endswith(("in_proj_a", "in_proj_b")):
                b = _reorder_v_heads(b, 0, n_k, v_per_k, 1)
            elif name.endswith("out_proj"):
                a = _reorder_v_heads(a, 1, n_k, v_per_k, dv)
    return np.ascontiguousarray(a), np.ascontiguousarray(b)


def _lora_pairs(model: peft.PeftModel) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(module name in the HF model, A [r, in], B [out, r]) for each adapted layer."""
    adapter = model.active_adapter
    config: Any = model.peft_config[adapter]  # a LoraConfig (PEFT types it as the base PeftConfig)
    if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False) or config.bias != "none":
        raise AdapterError("GGUF adapter export supports plain LoRA only (no DoRA, no bias)")
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
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
        yield name, lora_a.weight, lora_b.weight


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


def write_gguf_adapter(model: peft.PeftModel, path: Path, *, base_gguf: Path | None = None) -> None:
    """Write the active adapter as a llama.cpp GGUF LoRA adapter at `path` (atomically).

    Tensors are the base GGUF tensor names + `.lora_a` [r, in] / `.lora_b` [out, r] (numpy shapes; GGUF
    stores dims reversed), float32, in the base GGUF's row order. With `base_gguf`, every tensor is
    checked against the base the way llama.cpp's loader does.
    """
    if not isinstance(model, peft.PeftModel):
        raise AdapterError("the model has no adapter to export (it is not a PEFT model)")
    path = Path(path)
    config: Any = model.get_base_model().config
    arch = _gguf_arch(config)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    base = _base_tensors(Path(base_gguf), arch) if base_gguf is not None else None

    tensors = {}
    for name, a, b in _lora_pairs(model):
        gguf_name = name_map.get_name(name + ".weight", try_suffixes=(".weight",))
        if gguf_name is None:
            raise AdapterError(f"'{name}' has no tensor in llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} models")
        a_np = a.detach().to("cpu", torch.float32).numpy()
        b_np = b.detach().to("cpu", torch.float32).numpy()
        if base is not None:
            # llama.cpp: W.ne = [in, out], and the tensor must exist in the base.
            if gguf_name not in base:
                raise AdapterError(f"base GGUF has no tensor '{gguf_name}' for '{name}'")
            if base[gguf_name][:2] != (a_np.shape[1], b_np.shape[0]):
                raise AdapterError(f"'{name}' is {b_np.shape[0]}x{a_np.shape[1]}, but '{gguf_name}' in the "
                                   f"base GGUF is {base[gguf_name][1]}x{base[gguf_name][0]}")
        a_np, b_np = _to_gguf_layout(arch, name, a_np, b_np, config)
        tensors[gguf_name + ".lora_a"] = a_np
        tensors[gguf_name + ".lora_b"] = b_np
    if not tensors:
        raise AdapterError("the adapter has no LoRA weights")

    with staged_file(path) as tmp:
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


# ---------------------------------------------------------------------------------------------------------
# merge


def merge_into_base(base_spec: str | None, adapter_dir: str | Path, out: str | Path, *, seed: int = 0,
                    num_layers: int | None = None) -> list[str]:
    """Load the base, apply the adapter, merge it into the weights and save an HF model folder at `out`.

    base_spec: the base model; None takes the one the adapter records. seed and num_layers are for the
    random-weight presets, as in `load_model`. Returns the written files.
    """
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise AdapterError(f"'{adapter_dir}' is not an adapter folder (no adapter_config.json)")
    try:
        config = peft.PeftConfig.from_pretrained(str(adapter_dir))
    except (OSError, ValueError, TypeError) as e:
        raise AdapterError(f"cannot read the adapter in '{adapter_dir}': {e}") from None
    spec = base_spec if base_spec is not None else config.base_model_name_or_path
    if not spec:
        raise AdapterError(f"the adapter in '{adapter_dir}' does not record its base model: give one")
    try:
        lm = load_model(None if spec == DEFAULT_BASE else spec, seed=seed, num_layers=num_layers)
    except ModelError as e:
        raise AdapterError(f"cannot load the base model: {e}") from None

    try:
        model = peft.PeftModel.from_pretrained(lm.model, adapter_dir)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise AdapterError(f"the adapter in '{adapter_dir}' does not fit the base model '{spec}': "
                           f"{one_line(e)}") from None
    # PEFT only warns about adapter weights it could not place; a partial merge would be silently wrong.
    with safetensors.safe_open(adapter_dir / "adapter_model.safetensors", "pt") as f:
        saved = set(f.keys())
    loaded = set(peft.get_peft_model_state_dict(model, save_embedding_layers=False))  # "auto" asks the hub
    if saved != loaded:
        raise AdapterError(f"the adapter in '{adapter_dir}' does not fit the base model '{spec}' "
                           f"({len(saved ^ loaded)} tensors differ)")

    merged = model.merge_and_unload()
    merged.config.use_cache = True  # load_model turns the KV cache off for training; inference wants it
    with staged(out, error=AdapterError) as tmp:
        merged.save_pretrained(tmp)
        lm.tokenizer.save_pretrained(tmp)
        files = listing(tmp, Path(out))
    return files
