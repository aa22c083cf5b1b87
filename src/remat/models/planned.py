"""How a model spec's frozen weights will be held, from headers alone: what a plan sizes (`gate.Planners`).

A GGUF: the types its header gives (`gguf_file.planned_types`: kept in blocks, or float32 where loading
dequantizes). An HF folder: its config's float16 / bfloat16, as `load_model` keeps them. A preset: float32.
`weights` (a llama.cpp file type, `mixes.MIXES`) sizes any spec at that mix instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from remat.base.settings import Note, UsageError
from remat.models import gguf_file, mixes, stored
from remat.models import load as models


def stored_types(spec: str | None, weights: str | None, model: nn.Module) -> dict[str, int]:
    """The parameter name -> stored type of each weight a model of `spec` holds as stored (none: float32)."""
    if weights is not None:
        try:
            return mixes.types(model, weights)
        except ValueError as e:
            raise UsageError(f"--weights {weights}: {e}") from None
    kind, target = models.kind(spec)
    if kind == "gguf":
        arch, header = models.gguf_header(target)
        if gguf_file.transformers_converts(arch):  # loaded dequantized (`models._load_gguf`)
            return {}
        try:
            return gguf_file.planned_types(header, arch, model)
        except gguf_file.GGUFError as e:
            raise models.ModelError(f"cannot plan GGUF '{target}': {e}") from None
    if kind in ("folder", "config"):
        config: Any = model.config
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if dtype in stored.FLOAT_TYPES:
            keep32 = set(getattr(model, "_keep_in_fp32_modules", None) or ())
            return {name: stored.FLOAT_TYPES[dtype] for name, _ in model.named_parameters()
                    if not keep32 & set(name.split("."))}
    return {}


def plan_as_stored(model: nn.Module, spec: str | None, weights: str | None, lora: bool) -> nn.Module:
    """The planning model holding its frozen weights as a loaded one will (LoRA). Full fine-tuning trains float32
    copies of stored weights (`load_model(as_stored=False)`): planned in float32, and a note says so."""
    types = stored_types(spec, weights, model)
    if lora:
        return stored.plan_as_stored(model, types)
    if types and weights is None:
        warnings.warn("full fine-tuning trains float32 copies of the stored (quantized or half) weights: planned "
                      "in float32", Note, stacklevel=3)
    return model
