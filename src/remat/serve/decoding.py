"""A generation request as the decode loop sees it: its settings (`Params`), its choices (`Choice`, one sequence
each: tokens, text, stop rules, timings) and the events it sends its client (`Generation`).

The decode loop (`remat.serve.decoder`) hands each choice its sampled tokens (`Choice.accept`); the choice
turns them into text, applies the stop rules and reports pieces of text through its generation's `sink`
(called from the decode loop's thread: the routes bridge it to the event loop). A piece is held back while
its end may be the start of a stop string.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.serve.sampling import Row, Sampling, TokenProbs

__all__ = ["Choice", "Event", "Generation", "Params"]


@dataclass(frozen=True)
class Params:
    """One request's decoding settings beyond sampling."""

    sampling: Sampling = field(default_factory=Sampling)
    n_predict: int = -1  # -1: until the end of text or the context is full
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()  # token ids that stop like a stop string
    seed: int = -1  # -1: a random seed
    ignore_eos: bool = False
    t_max_predict_ms: int = 0  # > 0: stop at a new line once decoding took this long
    lora: tuple[tuple[int, float], ...] | None = None  # (id, scale): overrides the global scales

    def as_dict(self) -> dict:
        return {**self.sampling.as_dict(), "n_predict": self.n_predict, "max_tokens": self.n_predict,
                "stop": list(self.stop) + sorted(self.stop_ids),
                "seed": self.seed, "ignore_eos": self.ignore_eos, "t_max_predict_ms": self.t_max_predict_ms,
                "lora": None if self.lora is None else [{"id": i, "scale": s} for i, s in self.lora]}


@dataclass
class Event:
    """What a generation tells its client: `piece` (choice `index`'s new text, its tokens and their
    probabilities), `done` (choice `index` ended), `end` (every choice ended) or `error`."""

    kind: str
    index: int = 0
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenProbs] = field(default_factory=list)
    error: BaseException | None = None


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


class Choice:
    """One sequence of a generation: a prompt decoded to the end. After it ends, the fields hold the result."""

    def __init__(self, gen: Generation, index: int, prompt_ids: list[int], budget: int, tokenizer,
                 eos_ids: set[int]):
        p = gen.params
        self.gen, self.index, self.prompt_ids, self.budget = gen, index, prompt_ids, budget
        self.eos_ids = set() if p.ignore_eos else eos_ids  # ignore_eos bans them instead (a logit bias)
        self.row = Row(p.sampling, torch.Generator().manual_seed(gen.seed + index), list(prompt_ids))
        self.tokens: list[int] = []
        self.probs: list[TokenProbs] = []
        self.content = ""
        self.stop_type = "none"  # none | eos | limit | word
        self.stopping_word = ""
        self.prompt_ms = self.predicted_ms = 0.0
        self.t_start = self.t_first = 0.0
        self._text = _Detokenizer(tokenizer, prompt_ids)
        self._stops = [s for s in p.stop if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._searched = 0  # where the stop-string search resumes (`content` is what was handed out)
        self._held: tuple[list[int], list[TokenProbs]] = ([], [])  # tokens of text not handed out yet

    @property
    def done(self) -> bool:
        return self.stop_type != "none"

    def started(self) -> None:
        self.t_start = time.perf_counter()

    def accept(self, token: int, probs: TokenProbs | None) -> bool:
        """Take the next sampled token; True when the choice has ended."""
        now = time.perf_counter()
        if not self.tokens and not self.t_first:
            self.t_first = now
            self.prompt_ms = (now - self.t_start) * 1e3
        self.predicted_ms = (now - self.t_first) * 1e3
        if token in self.eos_ids:
            return self._end("eos")
        if token in self.gen.params.stop_ids:
            self.stopping_word = self._text.tokenizer.decode([token])
            return self._end("word")
        self.tokens.append(token)
        self.row.history.append(token)
        self._held[0].append(token)
        if probs is not None:
            self.probs.append(probs)
            self._held[1].append(probs)
        text = self._text.add(token)
        if self._stops and self._stop_string(text):
            return True
        t_max = self.gen.params.t_max_predict_ms
        if len(self.tokens) >= self.budget or (t_max > 0 and self.predicted_ms > t_max and "\n" in text):
            return self._end("limit")
        # Hold back a tail that may be the start of a stop string.
        safe = len(text) - max((_overlap(text, s, len(text) - len(self.content)) for s in self._stops), default=0)
        if safe > len(self.content):
            self._send(text[len(self.content):safe])
        return False

    def _stop_string(self, text: str) -> bool:
        found = [(text.find(s, max(0, self._searched - self._longest)), s) for s in self._stops]
        found = [(i, s) for i, s in found if i >= 0]
        self._searched = len(text)
        if not found:
            return False
        at, self.stopping_word = min(found)
        return self._end("word", text[:max(at, len(self.content))])

    def _send(self, text: str) -> None:
        """Hand out `text` (what follows `content`) with the tokens held since the last piece."""
        tokens, probs = self._held
        self._held = ([], [])
        self.content += text
        self.gen.sink(Event("piece", self.index, text, tokens, probs))

    def _end(self, stop_type: str, final: str | None = None) -> bool:
        """End with `final` as the whole text (by default all of it, an unfinished UTF-8 character as it is)."""
        self.stop_type = stop_type
        final = self._text.flush() if final is None else final
        if len(final) > len(self.content) or self._held[0]:
            self._send(final[len(self.content):])
        self.gen.sink(Event("done", self.index))
        self.gen.choice_done()
        return True

    def drop(self) -> None:
        """The client left: end here, with what was handed out (stop_type stays `none`)."""
        self.gen.sink(Event("done", self.index))
        self.gen.choice_done()

    def finish(self, stop_type: str) -> None:
        """End without a new token: the budget was 0, or the prompt filled the context."""
        now = time.perf_counter()
        self.prompt_ms = (now - self.t_start) * 1e3 if self.t_start else 0.0
        self._end(stop_type)

    @property
    def truncated(self) -> bool:
        return self.stop_type == "limit" and len(self.prompt_ids) + len(self.tokens) >= self.gen.n_ctx

    def timings(self) -> dict:
        return timings(len(self.prompt_ids), self.prompt_ms, len(self.tokens), self.predicted_ms)


def timings(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict:
    """llama.cpp's `timings` object."""
    return {
        "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms else 0.0,
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": predicted_n / predicted_ms * 1e3 if predicted_ms else 0.0,
    }


class Generation:
    """One request: its prompts, each decoded `n` times (choice index = prompt index x n + i). `start(sink)`
    hands it to the decode loop; `sink(event)` then gets every event, from the loop's thread."""

    def __init__(self, prompts: list[list[int]], params: Params, n: int, *, n_ctx: int, tokenizer,
                 eos_ids: set[int], key: Any, submit: Callable[[Generation], None],
                 cancel: threading.Event | None = None):
        self.params, self.n, self.n_ctx, self.key = params, n, n_ctx, key
        self.cancel = cancel or threading.Event()
        self.seed = params.seed if params.seed >= 0 else int.from_bytes(os.urandom(4), "little")
        self.prompts = prompts
        self.choices = [
            Choice(self, i, ids, n_ctx - len(ids) if params.n_predict < 0 else min(n_ctx - len(ids), params.n_predict),
                   tokenizer, eos_ids)
            for i, ids in enumerate(p for p in prompts for _ in range(n))]
        self._left = len(self.choices)
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.sink: Callable[[Event], None] = self._queue.put
        self._submit = submit

    def choice_done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self.sink(Event("end"))

    def fail(self, e: BaseException) -> None:
        """End every choice left with an error (the loop's thread)."""
        for c in self.choices:
            if not c.done:
                c.stop_type = "error"
        self._left = 0
        self.sink(Event("error", error=e))

    def start(self, sink: Callable[[Event], None] | None = None) -> None:
        if sink is not None:
            self.sink = sink
        self._submit(self)

    def run(self) -> None:
        """Decode to the end in this thread (tests, benchmarks); raises what the decoding raised."""
        self.start()
        while True:
            ev = self._queue.get()
            if ev.kind == "error":
                raise ev.error or RuntimeError("generation failed")
            if ev.kind == "end":
                return

    # -- results ----------------------------------------------------------------------------------------

    @property
    def n_prompt(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def n_predicted(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    def usage(self) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": self.n_predicted,
                "total_tokens": self.n_prompt + self.n_predicted}

    def timings(self) -> dict:
        """Every choice's: prompts counted once, decoding as the longest choice's wall time."""
        prompt_ms = sum(c.prompt_ms for c in self.choices[::self.n])
        return timings(self.n_prompt, prompt_ms, self.n_predicted, max(c.predicted_ms for c in self.choices))
