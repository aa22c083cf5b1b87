"""The served model for `remat serve`: loading, tokens, LoRA adapters, and generation requests.

The model is loaded once (eval mode). On a CPU it decodes from its stored blocks by default (`weights="blocks"`,
`remat.serve.packed`: a GGUF's quantized Linear weights through PyTorch's int4 kernel, bfloat16 products, the
activations float32); `weights="float32"`, or on another device, every weight is dequantized to float32 at load.

A request tokenizes its prompt here (`prompt_ids`, `chat_prompt`), is checked (context, adapters) and becomes a
`Generation` (`generate`) that the decode loop runs (`remat.serve.decoder`: one thread, the running sequences
batched, at most `parallel` at once).

LoRA: adapters are PEFT folders (the training jobs' outputs). They are loaded lazily, on the first request
that needs them, into a PEFT wrapper of the served model. Scales live on the model's LoRA layers, so requests
decode together only when they use the same adapters at the same scales; the decode loop applies a request's
settings (`apply_lora`) when nothing else is decoding.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from remat.base.settings import one_line
from remat.serve.batch import BatchCache, cache_bytes, prefill_cache, room_for_one
from remat.serve.decoder import Decoder
from remat.serve.decoding import Choice, Generation, Params
from remat.serve.errors import ApiError
from remat.serve.packed import pack_model
from remat.serve.schemas import CHARS_PER_TOKEN

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from remat.models.load import LoadedModel

__all__ = ["Engine"]

log = logging.getLogger("remat.serve")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable stand-in of each of the 256 bytes -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


BYTE_OF = _byte_alphabet()


class _FewRowsHead(torch.nn.Linear):
    """The output head while decoding: a few rows against a vocabulary-sized weight run as W @ x^T. MKL's GEMM
    of a few rows by a wide transposed weight re-packs the whole weight every call: SmolLM2's head took 33 ms
    for 4 rows that way and 18 this way (one row: 19 either way), most of what a batch of four cost over one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > 16:
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).T).T.reshape(*x.shape[:-1], self.weight.shape[0])
        return y if self.bias is None else y + self.bias


class Engine:
    """The served model. `load()` (slow) must finish before anything else is called."""

    # set by load(): nothing reads them before (the routes wait for the server to be ready)
    lm: LoadedModel
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    def __init__(self, spec: str | None, *, parallel: int = 1, n_ctx: int | None = None, scheduler=None,
                 adapters: Callable[[], list[dict]] | None = None, seed: int = 0, device: str = "cpu",
                 weights: str = "blocks", compile: bool = False, n_predict: int = -1):
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        if weights not in ("blocks", "float32"):
            raise ValueError(f"weights: blocks or float32, not {weights!r}")
        self.spec, self.seed, self.parallel = spec, seed, parallel
        self.device = torch.device(device)  # the model's: inputs go there, logits come back to the sampler's CPU
        # the int4 kernel is the CPU's: elsewhere the model decodes from float32 weights
        self.blocks = weights == "blocks" and self.device.type == "cpu"
        self.serving = {"packed": 0, "layers": 0, "float": 0}  # the serving copies' bytes (`packed.pack_model`)
        self.requested_ctx = n_ctx
        self.compile = compile
        self.n_predict = n_predict  # the most tokens a request generates, and what one naming none gets (-1: no limit)
        self._compiled: Callable | None = None  # the compiled decode step (`_compile_decode`), once it works
        self.scheduler = scheduler
        self.adapter_source = adapters or list
        self.decoder = Decoder(self)
        self.name = spec or "default"
        self.n_ctx = n_ctx or 0
        self.eos_ids: set[int] = set()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._peft: PeftModel | None = None  # the PEFT wrapper, once an adapter is loaded
        self._loaded: dict[int, tuple[str, str]] = {}  # adapter id -> (PEFT adapter name, path)
        self._cache_kw = "cache"
        self._kv_token = self._kv_fixed = 0  # KV bytes per token of a sequence, and per sequence
        self._stats_lock = threading.Lock()
        self.stats = {"requests": 0, "prompt_tokens": 0, "tokens_predicted": 0, "decode_seconds": 0.0,
                      "prompt_seconds": 0.0, "decode_steps": 0, "decode_rows": 0}

    # -- loading --------------------------------------------------------------------------------------

    def load(self) -> None:
        from remat.models.load import ModelError, load_model

        try:
            lm = load_model(self.spec, seed=self.seed, as_stored=self.blocks)
            if self.requested_ctx is not None and self.requested_ctx > lm.max_ctx:
                raise ModelError(f"--ctx {self.requested_ctx} is above the model's maximum context {lm.max_ctx}")
        except Exception as e:  # reported by /health; the server stays up
            self.load_error = one_line(e)
            raise
        model = torch.nn.Module.to(lm.model, self.device)
        model.eval()
        model.requires_grad_(False)
        model.config.use_cache = True  # load_model turns the cache off for training
        if self.blocks:
            self.serving = pack_model(model)
        head = model.get_output_embeddings()
        if type(head) is torch.nn.Linear:  # a plain head (a quantized one brings its own kernel)
            head.__class__ = _FewRowsHead
        params = inspect.signature(type(model).forward).parameters
        # transformers 5.x renamed past_key_values to cache; take whichever this version has.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        eos = {lm.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = {int(t) for t in eos if t is not None}
        self.lm, self.model, self.tokenizer, self.name = lm, model, lm.tokenizer, lm.name
        self.n_ctx = self.requested_ctx or lm.max_ctx
        self._kv_token, self._kv_fixed = self._kv_probe()
        if self.compile:
            self._compile_decode()
        self.ready.set()

    def _compile_decode(self) -> None:
        """`torch.compile` the step of one sequence decoding without adapters (`--compile`): it takes the Python
        of transformers' forward out of each token (SmolLM2 from the blocks, 2 threads: ~13 ms a token against
        ~19; compiling takes ~35 s with inductor's cache on disk warm, ~80 s cold). Traced once on a batch cache
        of two tokens, then run two more steps that must not compile again; where any of it fails the model
        decodes as before, with a note. `forward` takes it only for what it was traced with (`room_for_one`)."""
        start = time.perf_counter()
        step = torch.compile(self.model, dynamic=True)
        one, batch = prefill_cache(self.model), BatchCache(self.n_ctx)
        try:
            with torch.inference_mode():
                self._call(self.model, torch.zeros(1, 2, dtype=torch.long), one)
                batch.join(one, 2)
                for i in range(3):
                    if not room_for_one(batch.cache):
                        raise ValueError("its cache is not made of full-attention layers alone")
                    inputs = batch.inputs([0])
                    with torch.compiler.set_stance("fail_on_recompile") if i else contextlib.nullcontext():
                        self._call(step, inputs.pop("input_ids"), batch.cache, **inputs)
                    batch.advance()
        except Exception as e:  # noqa: BLE001 - the compiler fails in many ways; each means: decode eager
            log.warning("decoding without --compile: the step does not compile: %s", one_line(e))
            return
        self._compiled = step
        log.info("decode step compiled in %.0f s", time.perf_counter() - start)

    def _kv_probe(self) -> tuple[int, int]:
        """KV-cache bytes a sequence holds per token, and whatever it holds at any length (recurrent states):
        from the caches of a one- and a two-token forward."""
        sizes = []
        with torch.inference_mode():
            for n in (1, 2):
                cache = prefill_cache(self.model)
                self.forward(torch.zeros(1, n, dtype=torch.long), cache)
                sizes.append(cache_bytes(cache))
        return sizes[1] - sizes[0], 2 * sizes[0] - sizes[1]

    def vocab_size(self) -> int:
        emb = self.model.get_input_embeddings()
        if isinstance(emb, torch.nn.Embedding):  # its size without reading a stored weight (dequantized whole)
            return emb.num_embeddings
        weight = emb.weight
        assert isinstance(weight, torch.Tensor)  # torch types a submodule's attribute as Tensor | Module
        return int(weight.shape[0])

    # -- tokens -----------------------------------------------------------------------------------------

    @property
    def max_chars(self) -> int:
        """The longest text tokenized for a request: CHARS_PER_TOKEN per token of the context."""
        return CHARS_PER_TOKEN * self.n_ctx

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        if len(text) > self.max_chars:
            raise ApiError(413, f"the text has {len(text)} characters, more than this server tokenizes at once "
                           f"({self.max_chars}: {CHARS_PER_TOKEN} per token of its context {self.n_ctx})",
                           extra={"n_chars": len(text), "max_chars": self.max_chars})
        return list(self.tokenizer.encode(text, add_special_tokens=add_special))

    def check_tokens(self, tokens: list[int]) -> None:
        n = self.vocab_size()
        bad = [t for t in tokens if not 0 <= t < n]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of the vocabulary (0..{n - 1})")

    def detokenize(self, tokens: list[int]) -> str:
        self.check_tokens(tokens)
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        assert isinstance(text, str)  # one sequence of ids: one text
        return text

    def chat_prompt(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, variables: dict | None = None) -> tuple[str, list[int]]:
        """The prompt of a conversation through the model's chat template. `variables` are passed to the
        template as they are (llama.cpp's `chat_template_kwargs`, `reasoning_effort`)."""
        self.check_text(sum(len(m.get("content") or "") for m in messages))
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=False, **(variables or {}))
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages (roles, order)
            raise ApiError(400, f"cannot apply the chat template: {one_line(e)}") from None
        assert isinstance(text, str)  # tokenize=False: the rendered text
        self.check_text(len(text))
        return text, self.tokenize(text, add_special=False)  # the template writes any BOS itself

    def check_text(self, n_chars: int) -> None:
        """Refuse a prompt so long it cannot fit the context whatever it tokenizes to, before tokenizing."""
        if n_chars > self.max_chars:
            raise ApiError(400, f"the request exceeds the available context size ({n_chars} characters of prompt, "
                           f"over {CHARS_PER_TOKEN} per token of the context {self.n_ctx}): shorten the prompt",
                           type="exceed_context_size_error", extra={"n_prompt_chars": n_chars, "n_ctx": self.n_ctx})

    def prompt_ids(self, prompt: str | list[int | str]) -> list[int]:
        """A prompt's token ids: a text (with the model's BOS, as llama.cpp adds it), token ids, or token ids
        and texts mixed (the BOS only when it starts with a text)."""
        parts = [prompt] if isinstance(prompt, str) else prompt
        self.check_text(sum(len(x) for x in parts if isinstance(x, str)))
        ids: list[int] = []
        for i, x in enumerate(parts):
            ids += self.tokenize(x, add_special=i == 0) if isinstance(x, str) else [x]
        self.check_tokens(ids)
        if not ids:
            raise ApiError(400, "the prompt is empty")
        return ids

    def check_context(self, ids: list[int]) -> None:
        if len(ids) >= self.n_ctx:
            raise ApiError(
                400, f"the request exceeds the available context size ({len(ids)} prompt tokens, "
                     f"context {self.n_ctx}): shorten the prompt",
                type="exceed_context_size_error", extra={"n_prompt_tokens": len(ids), "n_ctx": self.n_ctx})

    # -- adapters ---------------------------------------------------------------------------------------

    def lora_key(self, override: tuple[tuple[int, float], ...] | None) -> tuple[tuple[int, float, str], ...]:
        """The adapters a request uses: ((id, scale, path), ...) with scale != 0, sorted by id."""
        known = {int(a["id"]): a for a in self.adapter_source()}
        if override is None:
            scales = {i: float(a.get("scale", 0.0)) for i, a in known.items()}
        else:
            scales = {}
            for i, scale in override:
                if i not in known:
                    raise ApiError(400, f"lora: no adapter with id {i} (GET /lora-adapters lists them)")
                scales[i] = scale
        return tuple((i, s, str(known[i]["path"])) for i, s in sorted(scales.items()) if s != 0)

    def _load_adapter(self, adapter_id: int, path: str) -> None:
        import peft

        from remat.models.load import module_lock
        from remat.models.stored import peeking

        name = f"adapter_{adapter_id}"
        if adapter_id in self._loaded and self._peft is not None:  # the same id at a new path: replace it
            self._peft.delete_adapter(self._loaded.pop(adapter_id)[0])
        if not (Path(path) / "adapter_config.json").is_file():
            raise ApiError(400, f"adapter {adapter_id} cannot be loaded: '{path}' has no adapter_config.json")
        # low_cpu_mem_usage: the LoRA layers are made empty and filled from the file, with no random init, so
        # loading never draws from the global RNG a training job may be using. While it runs, every module
        # made in the process is empty: the lock keeps the trainer and the planner from making one meanwhile.
        try:
            with module_lock, peeking(self.model):  # PEFT reads each layer's weight for its shape and device
                if self._peft is None:
                    self._peft = peft.PeftModel.from_pretrained(self.model, path, adapter_name=name,
                                                                is_trainable=False, low_cpu_mem_usage=True)
                else:
                    self._peft.load_adapter(path, adapter_name=name, is_trainable=False, low_cpu_mem_usage=True)
        except Exception as e:  # noqa: BLE001 - PEFT raises many kinds; all mean it does not fit
            raise ApiError(400, f"adapter {adapter_id} does not fit the served model: {one_line(e)}") from None
        self._loaded[adapter_id] = (name, path)

    def apply_lora(self, key: tuple[tuple[int, float, str], ...]) -> None:
        """Make the model compute with exactly these adapters at these scales (nobody decodes meanwhile)."""
        from peft.tuners.lora import LoraLayer, LoraModel

        for i, _, path in key:
            if self._loaded.get(i, (None, None))[1] != path:
                self._load_adapter(i, path)
        if self._peft is None:
            return  # no adapter was ever loaded: the plain model
        tuner = self._peft.base_model
        assert isinstance(tuner, LoraModel)  # every adapter here is a LoRA
        if not key:
            tuner.disable_adapter_layers()
            return
        names = [self._loaded[i][0] for i, _, _ in key]
        try:
            tuner.set_adapter(names, inference_mode=True)
        except TypeError:  # PEFT before inference_mode existed
            tuner.set_adapter(names)
        tuner.enable_adapter_layers()
        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                for (_, scale, _), name in zip(key, names):
                    module.set_scale(name, scale)  # scaling = scale * alpha / r


    # -- decoding ---------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: Params, n: int = 1,
                 cancel: threading.Event | None = None) -> Generation:
        """A Generation of `n` choices per prompt, to `start`. Checks the request (context size, adapters)
        before anything runs."""
        for ids in prompts:
            self.check_context(ids)
        if n > self.parallel:
            raise ApiError(400, f"n: {n} choices, more than this server decodes at once (--parallel {self.parallel})",
                           extra={"param": "n"})
        return Generation(prompts, params, n, n_ctx=self.n_ctx, tokenizer=self.tokenizer, eos_ids=self.eos_ids,
                          key=self.lora_key(params.lora), submit=self.decoder.submit, cancel=cancel)

    def close(self) -> None:
        self.decoder.close()

    def forward(self, input_ids: torch.Tensor, cache, **kw):
        """The model's forward over `input_ids` onto `cache`: the last position's logits. The model is a black
        box called with transformers' arguments, so a faster forward (quantized weights) drops in here."""
        step = self._compiled if self._compiled is not None and self._peft is None and input_ids.shape == (1, 1) \
            and "attention_mask" not in kw and room_for_one(cache) else None
        # The compiled step's guards are not checked (they cost ~4 ms a token): the test above is its guard.
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True) if step is not None else contextlib.nullcontext():
            out = self._call(self.model if step is None else step, input_ids, cache, **kw)
        out.logits = out.logits.to("cpu")  # sampled on the CPU; on a device this waits for the step: timed whole
        return out

    def _call(self, model: Callable, input_ids: torch.Tensor, cache, **kw):
        kw = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        return model(input_ids=input_ids.to(self.device), use_cache=True, logits_to_keep=1,
                     **{self._cache_kw: cache}, **kw)

    def decode_begin(self) -> None:
        """A sequence took a slot (the scheduler counts busy slots)."""
        if self.scheduler is not None:
            self.scheduler.decode_begin()

    def decode_end(self) -> None:
        if self.scheduler is not None:
            self.scheduler.decode_end()

    def stepped(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` sequences took `seconds`: for /metrics and the training scheduler."""
        with self._stats_lock:
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += rows
        if self.scheduler is not None:
            self.scheduler.step(rows, seconds)

    def record(self, c: Choice) -> None:
        """A choice ended: count it in the stats /metrics reports."""
        with self._stats_lock:
            st = self.stats
            st["requests"] += c.index == 0
            st["prompt_tokens"] += len(c.prompt_ids) if c.index % c.gen.n == 0 else 0  # a prompt once
            st["tokens_predicted"] += len(c.tokens)
            st["decode_seconds"] += c.predicted_ms / 1e3
            st["prompt_seconds"] += c.prompt_ms / 1e3

    # -- the training gate's view -----------------------------------------------------------------------

    def kv_cache_bytes(self) -> int:
        """Bytes the decode slots' KV caches hold now (already in use: the free memory does not count them)."""
        return self.decoder.kv_bytes()

    def kv_cache_reserve(self) -> int:
        """The most the decode slots' KV caches can hold: every slot at the full context (with the batch's
        growth step). A training job's budget leaves room for what of this is not held yet."""
        return self.parallel * (self._kv_fixed + self._kv_token * self.n_ctx)

    def token_piece(self, token: int) -> tuple[str, list[int]]:
        """A token's own text and its bytes, as the logprobs of OpenAI and llama.cpp report them: the bytes
        of a byte-level BPE token (GPT-2's alphabet), else of its decoded text; the text is their longest
        UTF-8 prefix."""
        name = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(name, str) and name and all(ch in BYTE_OF for ch in name):
            raw = bytes(BYTE_OF[ch] for ch in name)
        else:
            raw = str(self.tokenizer.decode([token])).encode("utf-8", "surrogatepass")
        for cut in range(len(raw), max(len(raw) - 4, -1), -1):
            try:
                return raw[:cut].decode("utf-8"), list(raw)
            except UnicodeDecodeError:
                continue
        return raw.decode("utf-8", "replace"), list(raw)
