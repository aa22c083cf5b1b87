"""Text generation for `remat serve`: one Hugging Face model, KV-cached decoding, sampling, LoRA adapters.

The served model is loaded once (float32, CPU, eval mode). Each request tokenizes its prompt, takes a
slot (at most `parallel` requests decode at once; the rest wait in arrival order), runs the prompt
through the model once, then decodes token by token over the KV cache and yields text as it appears.

LoRA: adapters are PEFT folders (the training jobs' outputs). They are loaded lazily, on the first
request that needs them, into a PEFT wrapper of the served model. Scales live on the model's LoRA
layers, so requests decode together only when they use the same adapters at the same scales; a request
with other settings waits until the running ones finish, and its settings are applied in between.
"""

from __future__ import annotations

import collections
import inspect
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from remat.base.settings import one_line
from remat.serve.errors import ApiError
from remat.serve.schemas import CHARS_PER_TOKEN

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from remat.models.load import LoadedModel

__all__ = ["Engine", "Generation", "SamplingParams"]



@dataclass
class SamplingParams:
    """llama.cpp's sampling settings and their defaults. temperature <= 0 means greedy."""

    n_predict: int = -1  # -1: until end of text or the context is full
    temperature: float = 0.8
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    seed: int = -1  # -1: a random seed
    stop: list[str] = field(default_factory=list)
    lora: list[dict] | None = None  # [{"id", "scale"}]: overrides the global scales; unlisted adapters get 0

    def as_dict(self) -> dict:
        return {"n_predict": self.n_predict, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed, "stop": list(self.stop),
                "lora": [dict(x) for x in self.lora] if self.lora is not None else None}


# ---------------------------------------------------------------------------------------------------------
# sampling


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from the last position's logits, in llama.cpp's order: top-k, top-p, min-p, temperature."""
    if p.temperature <= 0:
        return int(torch.argmax(torch.nan_to_num(logits, nan=-math.inf)))
    logits = torch.nan_to_num(logits.to(torch.float32), nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits[logits < kth] = -math.inf
    if p.top_p < 1 or p.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
            drop = before >= max(p.top_p, 0.0)
            drop[0] = False  # always keep the most likely token
            logits[order[drop]] = -math.inf
        if p.min_p > 0:
            logits[probs < p.min_p * probs.max()] = -math.inf
    # Scaled after subtracting the maximum: no temperature (1e-300, 1e300) overflows to inf - inf.
    logits = torch.nan_to_num(logits, nan=-math.inf)
    top = logits.max()
    if not torch.isfinite(top):  # nothing finite left (an adapter at an extreme scale): the best token
        return int(torch.argmax(logits))
    probs = torch.softmax((logits - top) / p.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs, 1, generator=gen))


# ---------------------------------------------------------------------------------------------------------
# slots


class _Slots:
    """At most `parallel` decoders at once, admitted in arrival order, all with the same LoRA settings.

    `acquire(key, apply)` returns when the caller may decode; when the settings must change, `apply(key)`
    runs first, while nobody decodes.
    """

    def __init__(self, parallel: int):
        self.parallel = parallel
        self.cond = threading.Condition()
        self.queue: collections.deque[object] = collections.deque()
        self.busy = 0
        self.key: object = None

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def acquire(self, key: Any, apply: Callable[[Any], None], cancel: threading.Event | None = None) -> bool:
        """False (and no slot) when `cancel` is set while waiting."""
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            try:
                while not (self.queue[0] is ticket and self.busy < self.parallel
                           and (self.busy == 0 or self.key == key)):
                    if cancel is not None and cancel.is_set():
                        return False
                    self.cond.wait(0.1)
                if self.key != key:
                    self.key = None  # if applying fails half way, the next request applies its own in full
                    apply(key)
                    self.key = key
                self.busy += 1
                return True
            finally:
                self.queue.remove(ticket)
                self.cond.notify_all()

    def release(self) -> None:
        with self.cond:
            self.busy -= 1
            self.cond.notify_all()


# ---------------------------------------------------------------------------------------------------------
# the engine


def _overlap(text: str, stop: str, limit: int) -> int:
    """The length of the longest tail of `text` (at most `limit`) that `stop` starts with, shorter than it."""
    for k in range(min(len(stop) - 1, limit), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


class _Detokenizer:
    """Generated tokens to text, incrementally: decodes a short window, not everything, per token.

    Text is only added at a clean boundary (no unfinished UTF-8 character at the end), and the window
    starts a few tokens back, so tokenizers that drop a word's leading space at the start of a text
    (SentencePiece) keep it. `flush()` adds whatever is left at the end.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-4:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens before this are in `text`
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self.text

    def flush(self) -> str:
        if self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix:self.read])
            self.text += self._decode(self.ids[self.prefix:])[len(before):]
            self.prefix = self.read = len(self.ids)
        return self.text


class Generation:
    """One request's decoding. Iterate it for text pieces; afterwards the fields hold the result."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams,
                 cancel: threading.Event | None):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.cancel = cancel or threading.Event()
        self.tokens: list[int] = []
        self.content = ""
        self.stop_type = "none"  # none | eos | limit | word
        self.stopping_word = ""
        self.seed = params.seed if params.seed >= 0 else int.from_bytes(os.urandom(4), "little")
        self.prompt_ms = 0.0
        self.predicted_ms = 0.0
        self._started = False

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_predicted(self) -> int:
        return len(self.tokens)

    @property
    def truncated(self) -> bool:
        return self.stop_type == "limit" and self.n_prompt + self.n_predicted >= self.engine.n_ctx

    def timings(self) -> dict:
        pn, dn = self.n_prompt, self.n_predicted
        return {
            "prompt_n": pn, "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / pn if pn else 0.0,
            "prompt_per_second": pn / self.prompt_ms * 1e3 if self.prompt_ms else 0.0,
            "predicted_n": dn, "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / dn if dn else 0.0,
            "predicted_per_second": dn / self.predicted_ms * 1e3 if self.predicted_ms else 0.0,
        }

    def run(self) -> str:
        """Decode to the end without streaming; returns the content."""
        for _ in self:
            pass
        return self.content

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise RuntimeError("a Generation runs once")
        self._started = True
        return self.engine._decode(self)


class Engine:
    """The served model. `load()` (slow) must finish before anything else is called."""

    # set by load(): nothing reads them before (the routes wait for the server to be ready)
    lm: LoadedModel
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    def __init__(self, spec: str | None, *, parallel: int = 1, n_ctx: int | None = None, scheduler=None,
                 adapters: Callable[[], list[dict]] | None = None, seed: int = 0):
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        self.spec, self.seed, self.parallel = spec, seed, parallel
        self.requested_ctx = n_ctx
        self.scheduler = scheduler
        self.adapter_source = adapters or list
        self.slots = _Slots(parallel)
        self.name = spec or "default"
        self.n_ctx = n_ctx or 0
        self.eos_ids: set[int] = set()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._peft: PeftModel | None = None  # the PEFT wrapper, once an adapter is loaded
        self._loaded: dict[int, tuple[str, str]] = {}  # adapter id -> (PEFT adapter name, path)
        self._cache_kw = "cache"
        self._stats_lock = threading.Lock()
        self.stats = {"requests": 0, "prompt_tokens": 0, "tokens_predicted": 0, "decode_seconds": 0.0,
                      "prompt_seconds": 0.0}

    # -- loading --------------------------------------------------------------------------------------

    def load(self) -> None:
        from remat.models.load import ModelError, load_model

        try:
            lm = load_model(self.spec, seed=self.seed, as_stored=False)  # float32: not decoding from blocks yet
            if self.requested_ctx is not None and self.requested_ctx > lm.max_ctx:
                raise ModelError(f"--ctx {self.requested_ctx} is above the model's maximum context {lm.max_ctx}")
        except Exception as e:  # reported by /health; the server stays up
            self.load_error = one_line(e)
            raise
        model = lm.model
        model.eval()
        model.requires_grad_(False)
        model.config.use_cache = True  # load_model turns the cache off for training
        params = inspect.signature(type(model).forward).parameters
        # transformers 5.x renamed past_key_values to cache; take whichever this version has.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        eos = {lm.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = {int(t) for t in eos if t is not None}
        self.lm, self.model, self.tokenizer, self.name = lm, model, lm.tokenizer, lm.name
        self.n_ctx = self.requested_ctx or lm.max_ctx
        self.ready.set()

    def vocab_size(self) -> int:
        weight = self.model.get_input_embeddings().weight
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

    def chat_prompt(self, messages: list[dict]) -> tuple[str, list[int]]:
        self.check_text(sum(len(m["content"]) for m in messages))
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_text(len(prompt))
            ids = self.tokenize(prompt, add_special=True)
        else:
            self.check_tokens(prompt)
            ids = list(prompt)
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

    def lora_key(self, override: list[dict] | None) -> tuple[tuple[int, float, str], ...]:
        """The adapters a request uses: ((id, scale, path), ...) with scale != 0, sorted by id."""
        known = {int(a["id"]): a for a in self.adapter_source()}
        if override is None:
            scales = {i: float(a.get("scale", 0.0)) for i, a in known.items()}
        else:
            scales = {}
            for entry in override:
                i = entry.get("id")
                if i not in known:
                    raise ApiError(400, f"lora: no adapter with id {i} (GET /lora-adapters lists them)")
                scales[i] = float(entry.get("scale", 1.0))
        return tuple((i, s, str(known[i]["path"])) for i, s in sorted(scales.items()) if s != 0)

    def _load_adapter(self, adapter_id: int, path: str) -> None:
        import peft

        from remat.models.load import module_lock

        name = f"adapter_{adapter_id}"
        if adapter_id in self._loaded and self._peft is not None:  # the same id at a new path: replace it
            self._peft.delete_adapter(self._loaded.pop(adapter_id)[0])
        if not (Path(path) / "adapter_config.json").is_file():
            raise ApiError(400, f"adapter {adapter_id} cannot be loaded: '{path}' has no adapter_config.json")
        # low_cpu_mem_usage: the LoRA layers are made empty and filled from the file, with no random init, so
        # loading never draws from the global RNG a training job may be using. While it runs, every module
        # made in the process is empty: the lock keeps the trainer and the planner from making one meanwhile.
        try:
            with module_lock:
                if self._peft is None:
                    self._peft = peft.PeftModel.from_pretrained(self.model, path, adapter_name=name,
                                                                is_trainable=False, low_cpu_mem_usage=True)
                else:
                    self._peft.load_adapter(path, adapter_name=name, is_trainable=False, low_cpu_mem_usage=True)
        except Exception as e:  # noqa: BLE001 - PEFT raises many kinds; all mean it does not fit
            raise ApiError(400, f"adapter {adapter_id} does not fit the served model: {one_line(e)}") from None
        self._loaded[adapter_id] = (name, path)

    def _apply_lora(self, key: tuple[tuple[int, float, str], ...]) -> None:
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

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Generation:
        """A Generation to iterate. Checks the request (context size, adapters) before anything runs."""
        self.check_context(prompt_ids)
        if params.lora is not None:
            self.lora_key(params.lora)  # unknown adapter ids fail now, not mid-stream
        return Generation(self, prompt_ids, params, cancel)

    def _forward(self, ids: list[int], cache):
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[0, -1], new_cache

    def _decode(self, g: Generation) -> Iterator[str]:
        p = g.params
        key = self.lora_key(p.lora)
        if not self.slots.acquire(key, self._apply_lora, g.cancel):
            return  # the client left while waiting
        sched = self.scheduler
        if sched is not None:
            sched.decode_begin()
        try:
            yield from self._decode_in_slot(g)
        finally:
            if sched is not None:
                sched.decode_end()
            self.slots.release()
            with self._stats_lock:
                st = self.stats
                st["requests"] += 1
                st["prompt_tokens"] += g.n_prompt
                st["tokens_predicted"] += g.n_predicted
                st["decode_seconds"] += g.predicted_ms / 1e3
                st["prompt_seconds"] += g.prompt_ms / 1e3

    def _decode_in_slot(self, g: Generation) -> Iterator[str]:
        p = g.params
        budget = self.n_ctx - g.n_prompt
        if p.n_predict >= 0:
            budget = min(budget, p.n_predict)
        gen = torch.Generator().manual_seed(g.seed)
        stops = [s for s in p.stop if s]
        longest_stop = max((len(s) for s in stops), default=0)
        text_of = _Detokenizer(self.tokenizer, g.prompt_ids)
        sched = self.scheduler
        emitted = 0  # characters of text already handed out
        searched = 0  # where the stop-string search resumes
        text = ""
        if budget <= 0:
            g.stop_type = "limit"
            return
        with torch.inference_mode():
            t_prev = time.perf_counter()
            logits, cache = self._forward(g.prompt_ids, None)
            t_prefilled = time.perf_counter()
            g.prompt_ms = (t_prefilled - t_prev) * 1e3
            while not g.cancel.is_set():
                token = sample(logits, p, gen)
                now = time.perf_counter()
                g.predicted_ms += (now - max(t_prev, t_prefilled)) * 1e3
                if sched is not None:
                    sched.tokens(1, now - t_prev)
                t_prev = now
                if token in self.eos_ids:
                    g.stop_type = "eos"
                    break
                g.tokens.append(token)
                text = text_of.add(token)
                if stops:
                    found = [(text.find(s, max(0, searched - longest_stop)), s) for s in stops]
                    found = [(i, s) for i, s in found if i >= 0]
                    searched = len(text)
                    if found:
                        at, g.stopping_word = min(found)
                        g.stop_type, text = "word", text[:max(at, emitted)]
                        break
                if len(g.tokens) >= budget:
                    g.stop_type = "limit"
                    break
                # Hold back a tail that may be the start of a stop string.
                safe = len(text) - max((_overlap(text, s, len(text) - emitted) for s in stops), default=0)
                if safe > emitted:
                    piece, emitted = text[emitted:safe], safe
                    g.content = text[:emitted]
                    yield piece
                logits, cache = self._forward([token], cache)
            if g.stop_type == "none":  # cancelled: what was handed out is the content
                return
            if g.stop_type != "word":
                text = text_of.flush()  # an unfinished UTF-8 character at the end, as it is
            g.content = text
            if len(text) > emitted:
                yield text[emitted:]
