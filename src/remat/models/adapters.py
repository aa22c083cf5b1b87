"""LoRA adapters: attach them with PEFT, save them for PEFT and llama.cpp, merge them into the base.

An adapter folder holds PEFT's adapter_config.json + adapter_model.safetensors and `adapter.gguf`, the
same adapter as a llama.cpp GGUF LoRA (`llama-server --lora adapter.gguf`), for the families llama.cpp's
converter takes (`lora_gguf.CONVERTERS`). PEFT's `base_model_name_or_path` records the spec of the base model (a
preset name, a path, or "default" for the embedded model), so a merge can find the base again without
being told.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import safetensors
import torch
from torch import nn

from remat.base.files import listing, staged
from remat.base.settings import AdapterError, Note, one_line
from remat.models import stored
from remat.models.load import ModelError, load_model, module_lock
from remat.models.lora_gguf import GGUF_NAME, NoGGUF, write_gguf_adapter

if TYPE_CHECKING:  # peft takes a second to import: only LoRA pays for it
    import peft

__all__ = [
    "DEFAULT_BASE",
    "AdapterError",
    "LoraSettings",
    "apply_lora",
    "merge_into_base",
    "save_adapter",
]

DEFAULT_BASE = "default"  # base_model_name_or_path of an adapter trained on the embedded default model


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
    import peft
    if isinstance(model, peft.PeftModel):
        raise AdapterError("the model already has an adapter")
    _check_settings(model, s)  # before PEFT touches the model, so a bad setting leaves it as it was
    targets, _ = _targets(model, s)
    config = peft.LoraConfig(
        r=s.r,
        lora_alpha=s.alpha,  # type: ignore[arg-type]  # PEFT annotates int; it scales by any number
        lora_dropout=s.dropout,
        target_modules=targets,
        bias="none",
        task_type=peft.TaskType.CAUSAL_LM,
    )
    with module_lock, torch.random.fork_rng(devices=[]), stored.peeking(model):  # PEFT only inspects the weights
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def left_out(model: nn.Module, s: LoraSettings) -> str:
    """What the adapter `s` leaves out of the model, and why, in a line ("" when nothing)."""
    return _targets(model, s)[1]


def _targets(model: nn.Module, s: LoraSettings) -> tuple[list[str] | str, str]:
    """PEFT's target modules for `s`, and what they leave out. PEFT's "all-linear" is every linear layer except
    the output head, less those PEFT refuses or cannot wrap here."""
    if s.targets is not None:
        return list(s.targets), ""
    refused, odd = _peft_refused(model), _not_plain_linears(model)
    if not (refused or odd):
        return "all-linear", ""
    head = cast(Any, model).get_output_embeddings()
    targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                      if isinstance(m, nn.Linear) and m is not head and name.rsplit(".", 1)[-1] not in refused | odd})
    why = [f"{', '.join(sorted(refused))}: PEFT does not support them for this model"] if refused else []
    why += [f"{', '.join(sorted(odd))}: their forward is not x @ W.T + b, which LoRA adds to"] if odd else []
    return targets, f"LoRA leaves out {'; '.join(why)}"


def _not_plain_linears(model: nn.Module) -> set[str]:
    """Names of nn.Linear subclasses whose forward is not a linear map of the last dimension (DeepSeek-V4's
    grouped projection, PhiMoE's router returning a tuple): PEFT adds B·A·x to the layer's output, which fits
    only a forward of x @ W.T + b. A forward of their own that keeps that shape (Falcon's) is plain."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward and not _maps_rows(m)}


def _maps_rows(m: nn.Linear) -> bool:
    try:
        with torch.no_grad():
            out = m(m.weight.new_zeros(1, m.in_features))
    except Exception:  # noqa: BLE001 - a forward that wants another input is not a plain linear layer
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (1, m.out_features)


def _peft_refused(model: nn.Module) -> set[str]:
    """Linear layer names PEFT refuses as LoRA targets for this model (Mamba's out_proj), asked of PEFT's own check."""
    import peft
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
    When llama.cpp cannot take the adapter (a family its converter does not handle, or no adapted layer it
    can express), adapter.gguf is skipped with a warning; layers it cannot express are left out of it, with
    a warning for each kind.
    """
    import peft
    if not isinstance(model, peft.PeftModel):
        raise AdapterError("the model has no adapter to save (it is not a PEFT model)")
    out = Path(out)
    config = model.peft_config[model.active_adapter]
    with staged(out, error=AdapterError) as tmp:
        config.base_model_name_or_path = base_name
        # "auto" would look up base_name on the Hugging Face hub; the vocabulary never changes here.
        model.save_pretrained(str(tmp), save_embedding_layers=False)
        try:
            notes = write_gguf_adapter(model, tmp / GGUF_NAME, base_gguf=base_gguf)
        except NoGGUF as e:  # a base GGUF that does not fit is an error, not this
            warnings.warn(f"{GGUF_NAME} not written: {e}", stacklevel=2)
        else:
            for note in notes:
                warnings.warn(f"{GGUF_NAME} leaves out {note}", stacklevel=2)
        files = listing(tmp, out)
    return files


# ---------------------------------------------------------------------------------------------------------
# merge


def _float_base(model: nn.Module) -> None:
    """The base's stored weights (GGUF blocks, bf16) made float32 for the merge, in place, saying so: a merged
    weight is the float weight plus B·A, which no stored type holds."""
    kinds = Counter(stored.Q(p.qtype).name for _, p, _ in stored.stored(model))
    if kinds:
        held = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        warnings.warn(f"the base holds {held} weights: the merged model is written in float32", Note, stacklevel=3)
        stored.to_float(model)


def merge_into_base(base_spec: str | None, adapter_dir: str | Path, out: str | Path, *, seed: int = 0,
                    num_layers: int | None = None) -> list[str]:
    """Load the base, apply the adapter, merge it into the weights and save an HF model folder at `out`.

    base_spec: the base model; None takes the one the adapter records. seed and num_layers are for the
    random-weight presets, as in `load_model`. Returns the written files.
    """
    import peft
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
    _float_base(lm.model)

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
