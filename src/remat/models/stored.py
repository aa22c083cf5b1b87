"""Frozen weights held as the file stores them (GGUF blocks, an HF folder's bf16 or fp16), made float in the step.

A stored weight is a parameter holding the stored bytes, uint8 rows (`remat.models.quant`), under a
parametrization (`Stored`, `torch.nn.utils.parametrize`): reading `module.weight` runs `remat::dequantize`.
So the model's own code sees its float weight, eager or traced; a traced step reads the bytes as a frozen
placeholder and makes the float weight in the graph, where the rewrite recomputes it for the backward under
every policy (`remat.core.policies.ALWAYS_RECOMPUTED`): a layer's float weight exists while the layer computes.
PEFT wraps the layers by their names as before, so an adapter's keys are the same as on a float base. Modules
that share a weight (a tied embedding and head) share one parameter of bytes. A stored `nn.Embedding` makes only the
rows it looks up (`look_up_rows`), not its whole table.

Training a stored weight needs a float copy: full fine-tuning loads the model in float32 (`to_float`), as
serving and merging an adapter do for now.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import gguf
import torch
from torch import nn
from torch.nn.utils import parametrize

from remat.models import quant

Q = gguf.GGMLQuantizationType
# The stored types of an HF folder's float weights: their bytes are rows of one-element blocks.
FLOAT_TYPES = {torch.float16: Q.F16, torch.bfloat16: Q.BF16}
ORIGINAL = ".parametrizations.{}.original"  # where parametrize keeps a parameter's stored tensor


class Stored(nn.Module):
    """The parametrization of a stored weight: its bytes in, the weight of `shape` in `dtype` out."""

    def __init__(self, qtype: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qtype, self.shape, self.dtype = int(qtype), tuple(shape), dtype
        self.peek = False  # `peeking`: read as a stand-in

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        if self.peek:  # the weight's shape, dtype and device: no values, no memory
            return torch.zeros((), dtype=self.dtype, device=blocks.device).expand(self.shape)
        return torch.ops.remat.dequantize(blocks, self.qtype, self.shape, self.dtype)


@contextlib.contextmanager
def made_in(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """While on, the model's stored weights are made in `dtype` (a step's compute dtype, `remat.core.precision`):
    `remat::dequantize` converts its float32 values last, so they are the float32 weights cast, and no float32 copy
    is ever made. float32 leaves them as the model makes them (a float32 step computes as the model is)."""
    parts = [m for m in model.modules() if isinstance(m, Stored)] if dtype != torch.float32 else []
    was = [m.dtype for m in parts]
    for m in parts:
        m.dtype = dtype
    try:
        yield
    finally:
        for m, d in zip(parts, was):
            m.dtype = d


@contextlib.contextmanager
def peeking(model: nn.Module) -> Iterator[None]:
    """Reading the model's stored weights gives stand-ins (their shape, dtype and device) while on: for code that
    inspects weights without computing with them. PEFT reads each wrapped layer's weight 21 times to place its
    adapter: SmolLM2's 210 layers dequantized 4,410 weights, 7 s, and left 40 MiB of heap behind."""
    parts = [m for m in model.modules() if isinstance(m, Stored)]
    for m in parts:
        m.peek = True
    try:
        yield
    finally:
        for m in parts:
            m.peek = False


def rows(t: torch.Tensor) -> torch.Tensor:
    """A float16 or bfloat16 tensor's bytes as uint8 rows, `[..., row bytes]` (no copy)."""
    return t.contiguous().view(torch.uint8)


def keep(model: nn.Module, weights: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Hold each parameter named in `weights` (and every tie of it) as its bytes stored as its type (uint8 rows),
    read through `Stored`."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        module_name, _, attr = n.rpartition(".")
        holders.setdefault(id(p), []).append((model.get_submodule(module_name), attr))
    for name, (blocks, qtype) in weights.items():
        p = model.get_parameter(name)
        shape = tuple(p.shape)
        if blocks.dtype != torch.uint8 or blocks.numel() != quant.stored_bytes(qtype, shape):
            raise ValueError(f"{name}: {blocks.numel()} bytes of {blocks.dtype} do not store {Q(qtype).name} "
                             f"{list(shape)}")
        held = nn.Parameter(blocks, requires_grad=False)
        for module, attr in holders[id(p)]:
            plain_embedding = type(module) is nn.Embedding and attr == "weight" and module.max_norm is None
            setattr(module, attr, held)
            parametrize.register_parametrization(module, attr, Stored(qtype, shape), unsafe=True)
            if plain_embedding:
                module.forward = types.MethodType(look_up_rows, module)


def look_up_rows(emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """A stored embedding's forward: the rows of blocks looked up, then made float, so the table is never made
    whole (SmolLM2's: 28 M values for a window's 256 tokens, in every step). The same values: a row's values are
    its own blocks'. A bound method, so a deep copy of the model looks up in its own copy."""
    s, blocks = stored_of(emb)
    if s.peek:
        return nn.functional.embedding(ids, emb.weight)
    flat = ids.reshape(-1)
    looked_up = torch.ops.remat.dequantize(blocks.index_select(0, flat), s.qtype, (flat.numel(), s.shape[-1]),
                                           s.dtype)
    return looked_up.reshape(*ids.shape, s.shape[-1])


def stored_of(module: nn.Module, attr: str = "weight") -> tuple[Stored, torch.Tensor]:
    """The module's stored weight: its parametrization and its bytes (KeyError where it has none)."""
    plist = getattr(module, "parametrizations", {})[attr]
    if not isinstance(plist[0], Stored):
        raise KeyError(attr)
    return plist[0], plist.original


def stored(model: nn.Module) -> Iterator[tuple[str, Stored, torch.Tensor]]:
    """(the weight's name as the float model names it, its parametrization, its bytes), once per parameter."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, plist in getattr(module, "parametrizations", {}).items():
            if isinstance(plist[0], Stored) and id(plist.original) not in seen:
                seen.add(id(plist.original))
                yield f"{module_name}.{attr}".lstrip("."), plist[0], plist.original


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: what its stored weights are made in, else its first float parameter's
    (a stored weight's parameter is its bytes, so the first parameter no longer tells)."""
    made = next((s.dtype for _, s, _ in stored(model)), None)
    return made or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def float_name(name: str) -> str:
    """A parameter's name as the float model names it (a stored one's `...parametrizations.weight.original`)."""
    head, sep, tail = name.partition(".parametrizations.")
    return f"{head}.{tail.partition('.')[0]}" if sep else name


def to_float(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Make every stored weight a plain parameter in `dtype`, dequantized once (ties stay tied); in place."""
    floats: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        for attr, plist in list(getattr(module, "parametrizations", {}).items()):
            if not isinstance(plist[0], Stored):
                continue
            key = id(plist.original)
            if key not in floats:
                with torch.no_grad():
                    floats[key] = nn.Parameter(getattr(module, attr).to(dtype))
            parametrize.remove_parametrizations(module, attr, leave_parametrized=False)
            setattr(module, attr, floats[key])
            if getattr(module.forward, "__func__", None) is look_up_rows:
                del module.forward  # its class's own again
    return model


def stored_bytes(model: nn.Module) -> int:
    """The bytes the stored weights hold."""
    return sum(b.untyped_storage().nbytes() for _, _, b in stored(model))


def keep_floats(model: nn.Module) -> None:
    """An HF folder's float16 / bfloat16 weights held as they are (their bytes, `Stored`); float32 ones stay."""
    keep(model, {name: (rows(p.detach()), FLOAT_TYPES[p.dtype]) for name, p in model.named_parameters()
                 if p.dtype in FLOAT_TYPES})


def plan_as_stored(model: nn.Module, types: dict[str, int]) -> nn.Module:
    """A planning model (fake weights) whose parameters named in `types` are held as that type would store
    them: fake bytes of the stored size, read through `Stored`, as a loaded model holds them."""
    weights = {}
    for name, qtype in types.items():
        p = model.get_parameter(name)
        mode = getattr(p, "fake_mode", None)
        with mode if mode is not None else torch.device("meta"):
            weights[name] = torch.empty(*p.shape[:-1], quant.row_bytes(qtype, p.shape[-1]), dtype=torch.uint8), qtype
    keep(model, weights)
    return model
