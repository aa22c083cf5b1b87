"""A GGUF file's weights in a transformers model, kept in their blocks (`remat.models.stored`).

transformers dequantizes every tensor of a GGUF as it loads it; remat reads the blocks itself with gguf-py's
reader and maps them as transformers would: its names (`get_gguf_hf_weights_map`) and its tensor processors
(llama's Q/K row permutation, ...). Rows are independent in every GGUF type, so a processor that only moves,
splits or joins whole rows runs on the blocks as they are. A tensor whose conversion is not row-wise, one of
a type remat has no kernel for (`quant.KEPT`), and one whose rows are not the parameter's last dimension are
dequantized here, once, as transformers would (gguf-py), and held in float32; `NOT_ROW_WISE` lists the first
kind. An architecture that transformers converts through its own packed path (qwen35, qwen35moe, lfm2) is
loaded by transformers, dequantized (`transformers_converts`).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import quant_shape_to_byte_shape
from torch import nn
from transformers.integrations.gguf import is_gguf_arch_supported

from remat.models import quant, stored

Q = gguf.GGMLQuantizationType

# GGUF architecture -> the parts of tensor names whose conversion in transformers is not a reordering of whole
# rows: they are dequantized at load, as transformers converts them.
NOT_ROW_WISE: dict[str, tuple[str, ...]] = {
    "gpt2": ("attn_qkv.weight", "ffn_down.weight", "ffn_up.weight", "attn_output.weight", "output.weight"),  # .T
    "mamba": ("ssm_a",),  # A_log = log(-A)
    "nemotron": ("norm.weight",), "gemma2": ("norm.weight",), "gemma3": ("norm.weight",),  # w - 1
    "bloom": ("attn_qkv",),  # heads regrouped by element count along the row
    # experts stacked into the fused parameter by the processor itself (gate/up transposed for gpt-oss)
    "qwen2moe": ("_exps.weight",), "qwen3moe": ("_exps.weight",), "minimax-m2": ("_exps.weight",),
    "gpt-oss": ("_projs.weight",),
}


class GGUFError(ValueError):
    """A GGUF file remat cannot read; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor as the header describes it: its type, its shape in numpy order (rows last), and where its data
    starts in the file (-1: a tensor only planned)."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int = -1


def read(path: Path) -> gguf.GGUFReader:
    """gguf-py's reader of the file (its tensors' data mapped, not read); GGUFError for a damaged file or a tensor
    of a type remat cannot read."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, EOFError) as e:
        raise GGUFError(f"GGUF '{path}' is damaged or not a GGUF ({e.__class__.__name__}: {e}): a truncated file, "
                        "or a header whose sizes or offsets lie") from None
    if reader.byte_order != "I":
        raise GGUFError(f"GGUF '{path}' is big-endian: remat reads little-endian files")
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise GGUFError(f"GGUF '{path}': tensor {t.name} lies past the end of the file (a truncated file, or "
                            "a header whose sizes or offsets lie)")
        if t.tensor_type not in quant.KEPT and not _dequantizable(t.tensor_type):
            raise GGUFError(f"tensor {t.name} is {t.tensor_type.name}, a type remat cannot read")
    return reader


def architecture(reader: gguf.GGUFReader) -> str:
    field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if field is None:
        raise GGUFError("the GGUF has no general.architecture")
    return str(field.contents())


def tensors(reader: gguf.GGUFReader) -> list[Tensor]:
    return [Tensor(t.name, int(t.tensor_type), tuple(int(n) for n in reversed(t.shape.tolist())), int(t.data_offset))
            for t in reader.tensors]


# The numpy type gguf-py's reader gives each unquantized type; a quantized tensor is its rows' bytes (uint8).
_ITEMS = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
          Q.I32: np.int32, Q.I64: np.int64}


def mapped(path: Path, table: list[Tensor]) -> Iterator[tuple[Tensor, np.ndarray]]:
    """Each tensor of the file's `table` (`tensors`, kept from a first read) with its data as gguf-py's reader gives
    it, the file mapped, not read: the reader parses every field of the header again, the vocabulary too (2.6 s
    for SmolLM2's). Each tensor's pages are dropped from the process once the next is asked for (every value is
    copied by then). Read through the mapping, they count in the resident set until it is closed: a float32 GGUF's
    whole size again at load (SmolLM2: peak 1,580 MiB, 902 once loaded); dropped, a page read again comes back
    from the file."""
    data = np.memmap(path, mode="r")
    handle = getattr(data, "_mmap", None)
    for t in table:
        qtype, n_bytes = Q(t.qtype), quant.stored_bytes(t.qtype, t.shape)
        raw = data[t.offset:t.offset + n_bytes]
        item = _ITEMS.get(qtype)
        yield t, raw.view(item).reshape(t.shape) if item else raw.reshape(quant_shape_to_byte_shape(t.shape, qtype))
        if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
            start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
            handle.madvise(mmap.MADV_DONTNEED, start, t.offset + n_bytes - start)


def transformers_converts(arch: str) -> bool:
    """Whether transformers maps this architecture through its own conversions (not its tensor processors)."""
    return is_gguf_arch_supported(arch)


def _dequantizable(qtype: int) -> bool:
    size = gguf.GGML_QUANT_SIZES[Q(qtype)][1]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), Q(qtype))
    except NotImplementedError:
        return False
    return True


def kept_type(arch: str, t: Tensor, shape: tuple[int, ...]) -> int | None:
    """The type the parameter of `shape` holds `t` as: its own (kept in its blocks), or None (float32, plain).
    GGUFError for a type remat cannot read at all."""
    if t.qtype not in quant.KEPT and not _dequantizable(t.qtype):
        raise GGUFError(f"tensor {t.name} is {Q(t.qtype).name}, a type remat cannot read")
    if t.qtype == Q.F32 or t.qtype not in quant.KEPT or any(part in t.name for part in NOT_ROW_WISE.get(arch, ())):
        return None
    if shape[-1] != t.shape[-1] or int(np.prod(shape)) != int(np.prod(t.shape)):
        return None  # its rows are not the parameter's last dimension
    return t.qtype


def names(model: nn.Module, arch: str) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name (before anything is stored), as transformers maps them
    (`get_gguf_hf_weights_map`: gguf-py's name map, tried on each name and on the names inside each submodule,
    the processor's renames and fallbacks), in one pass: transformers builds the name map once per submodule,
    six seconds for SmolLM2."""
    kinds = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in kinds:
        raise GGUFError(f"gguf-py knows no GGUF architecture {arch!r}")
    config: Any = model.config  # torch types a module's attributes as Tensor | Module
    name_map = gguf.get_tensor_name_map(kinds[arch], config.num_hidden_layers)
    processor = _processor(model, arch)
    found: dict[str, tuple[int, str]] = {}  # GGUF name -> (depth of the submodule it was named in, parameter)
    for full in model.state_dict():
        hf = processor.preprocess_name(full)
        base, dot, suffix = hf.rpartition(".") if hf.endswith((".weight", ".bias")) else (hf, "", "")
        parts = base.split(".")
        depth = next((i for i in range(len(parts)) if name_map.get_name(".".join(parts[i:]))), None)
        if depth is None:
            fallback: dict[str, str] = {}
            processor.perform_fallback_tensor_mapping(fallback, dot + suffix, "", hf)
            found.update((g, (0, h)) for g, h in fallback.items())
            continue
        gguf_name = f"{name_map.get_name('.'.join(parts[depth:]))}{dot}{suffix}"
        if gguf_name not in found or depth <= found[gguf_name][0]:  # the outermost wins; among equals, the last
            found[gguf_name] = (depth, hf)
    return {g: h for g, (_, h) in found.items()}


def _processor(model: nn.Module, arch: str) -> Any:
    """transformers' tensor processor for the architecture (the identity for most)."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf  # 0.27 s (its tokenizers): not for a plan

    config: Any = model.config
    return hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)(config=config.to_dict())


def planned_types(header: list[Tensor], arch: str, model: nn.Module) -> dict[str, int]:
    """The model's parameter name -> the type a loaded model holds it as, for those kept in blocks: a plan's."""
    mapped = names(model, arch)
    params = dict(model.named_parameters())
    types = {}
    for t in header:
        name = mapped.get(t.name)
        if name in params:
            qtype = kept_type(arch, t, tuple(params[name].shape))
            if qtype is not None:
                types[name] = qtype
    return types


# The blocks of every GGUF tensor a live model holds, by (the file's identity, its name, the parameter's): a second
# model of the same file (a training job's beside the served model) holds the same tensors, not a copy. The
# blocks are frozen (only a LoRA's A and B train; a full fine-tune loads float32) and read-only for every user, so
# two module trees can share them, each with its own modules. An entry goes with the last model that holds it.
_BLOCKS: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def identity(path: Path) -> tuple:
    """What tells a file's bytes apart from another's while this process runs: where it is, its inode, size and
    modification time (a rewritten file is another file)."""
    st = path.stat()
    return str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def load_into(model: nn.Module, arch: str, file_tensors: Iterable[tuple[Tensor, np.ndarray]],
              file: tuple | None = None) -> list[str]:
    """Fill `model` (a skeleton: its parameters' values unset) with the tensors of a file of architecture `arch`
    (`mapped`); -> notes for the user (tensors dequantized at load, by type). `file`: the file's `identity`, to share
    the blocks of the tensors kept stored with any other model of it alive in this process (None: a copy of its
    own)."""
    mapped, processor = names(model, arch), _processor(model, arch)
    params = dict(model.named_parameters())  # a tied weight once, under its first name
    parsed: dict[str, Any] = {"tensors": {}}
    filled, dequantized, kept = set(), dict[str, int](), dict[str, tuple[torch.Tensor, int]]()
    keys: dict[str, tuple] = {}
    for info, raw in file_tensors:
        name = mapped.get(info.name, "")
        target = params.get(name)
        qtype = kept_type(arch, info, tuple(target.shape)) if target is not None else None
        data = np.asarray(raw) if qtype is not None else gguf.quants.dequantize(raw, Q(info.qtype))
        if qtype is None and info.qtype != Q.F32:
            dequantized[Q(info.qtype).name] = dequantized.get(Q(info.qtype).name, 0) + 1
        result = processor.process(weights=data, name=info.name, tensor_key_mapping=mapped, parsed_parameters=parsed)
        if result.name is None or result.name not in mapped or target is None:
            continue
        if qtype is None:
            _fill(model, name, torch.from_numpy(np.array(result.weights, copy=True)))
        else:
            keys[name] = (file, info.name, name, qtype)
            kept[name] = _blocks(result.weights, keys[name] if file is not None else None, target.shape), qtype
        filled.add(name)
    for name, value in parsed["tensors"].items():  # placed by the processor itself (MoE experts)
        if name in params:
            _fill(model, name, value.float())
            filled.add(name)
    stored.keep(model, kept)
    if file is not None:  # the parameters the model holds: alive as long as it is
        for name, _, held in stored.stored(model):
            if name in keys:
                _BLOCKS.setdefault(keys[name], held)
    missing = sorted(set(params) - filled)
    if missing:
        raise GGUFError(f"the GGUF has no tensor for {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    return [f"{n} {kind} tensor{'s' * (n > 1)} dequantized at load (float32)" for kind, n in dequantized.items()]


def _blocks(weights: Any, key: tuple | None, shape: torch.Size) -> torch.Tensor:
    """A kept tensor's blocks [..., row bytes] (uint8): the ones a live model of the same file holds under `key`
    (the same storage), else a copy of the file's."""
    found = None if key is None else _BLOCKS.get(key)
    if found is not None:
        return found.detach()
    return torch.from_numpy(np.array(weights, copy=True)).view(torch.uint8).reshape(*shape[:-1], -1)


def _fill(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """The parameter `name` (every tie of it) as `value`, float32."""
    p = model.get_parameter(name)
    if tuple(value.shape) != tuple(p.shape):
        raise GGUFError(f"tensor for {name} is {list(value.shape)}, the model's is {list(p.shape)}")
    held = nn.Parameter(value.float(), requires_grad=p.requires_grad)
    for module, attr in list(_holders(model, p)):  # a tied weight: one parameter for every holder
        setattr(module, attr, held)


def _holders(model: nn.Module, p: torch.Tensor) -> Iterator[tuple[nn.Module, str]]:
    for n, q in model.named_parameters(remove_duplicate=False):
        if q is p:
            module_name, _, attr = n.rpartition(".")
            yield model.get_submodule(module_name), attr
