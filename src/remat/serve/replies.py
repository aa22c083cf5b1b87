"""The answers of the generation routes, whole or streamed: llama.cpp's /completion, OpenAI's completions and
chat completions; with `usage`, llama.cpp's `timings` and the log-probabilities each shape reports."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from remat.base.settings import VERSION
from remat.serve import generation as gen
from remat.serve.decoding import Choice, Generation
from remat.serve.engine import Engine
from remat.serve.sampling import TokenProbs

__all__ = ["LlamaReply", "OpenAIReply"]


def finish_reason(c: Choice) -> str:
    return "length" if c.stop_type == "limit" else "stop"


class _Probs:
    """Token log-probabilities (or post-sampling probabilities) in llama.cpp's and OpenAI's shapes."""

    def __init__(self, e: Engine, post: bool):
        self.e, self.key = e, "prob" if post else "logprob"

    def _one(self, token: int, value: float, extra: dict | None = None) -> dict:
        text, raw = self.e.token_piece(token)
        return {"id": token, "token": text, "bytes": raw, self.key: value, **(extra or {})}

    def llama(self, tokens: list[int], probs: list[TokenProbs]) -> list[dict]:
        top = "top_probs" if self.key == "prob" else "top_logprobs"
        return [self._one(t, p.value, {top: [self._one(i, v) for i, v in p.top]}) for t, p in zip(tokens, probs)]

    def chat(self, tokens: list[int], probs: list[TokenProbs]) -> dict:
        content = self.llama(tokens, probs)
        for item in content:
            item.pop("id")
            for other in item.get("top_logprobs", item.get("top_probs", [])):
                other.pop("id")
        return {"content": content, "refusal": None}

    def text(self, tokens: list[int], probs: list[TokenProbs], offset: int) -> dict:
        """OpenAI's legacy completions shape: parallel lists, each top list a {token: logprob} map."""
        pieces = [self.e.token_piece(t)[0] for t in tokens]
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [p.value for p in probs],
                "top_logprobs": [{self.e.token_piece(i)[0]: v for i, v in p.top} for p in probs],
                "text_offset": offsets}


class LlamaReply:
    """llama.cpp's /completion answer: one object per choice (a list when there are several)."""

    def __init__(self, e: Engine, g: Generation, prompt_text: list[str], return_tokens: bool,
                 fields: list[str] | None, stream: bool):
        self.e, self.g, self.prompt_text, self.return_tokens = e, g, prompt_text, return_tokens
        self.fields, self.stream = fields, stream
        self.probs = _Probs(e, g.params.sampling.post_sampling_probs)

    def result(self, c: Choice) -> dict:
        g = self.g
        out: dict[str, Any] = {
            "index": c.index, "content": "" if self.stream else c.content,
            "tokens": c.tokens if self.return_tokens and not self.stream else [], "id_slot": 0, "stop": True,
            "model": self.e.name, "tokens_predicted": len(c.tokens), "tokens_evaluated": len(c.prompt_ids),
            "generation_settings": {**g.params.as_dict(), "seed": g.seed, "n_ctx": self.e.n_ctx, "model": self.e.name},
            "prompt": self.prompt_text[c.index // g.n], "has_new_line": "\n" in c.content, "truncated": c.truncated,
            "stop_type": c.stop_type, "stopping_word": c.stopping_word, "tokens_cached": 0, "timings": c.timings(),
        }
        if g.params.sampling.logprobs and not self.stream:
            out["completion_probabilities"] = self.probs.llama(c.tokens, c.probs)
        if self.fields:  # llama.cpp's response_fields: "a/b" is out["a"]["b"], under the key "a/b"
            picked = {}
            for path in self.fields:
                value: Any = out
                ok = True
                for key in path.split("/"):
                    ok = ok and isinstance(value, dict) and key in value
                    value = value[key] if ok else None
                if ok:
                    picked[path] = value
            out = picked
        return out

    def whole(self) -> dict | list[dict]:
        results = [self.result(c) for c in self.g.choices]
        return results[0] if len(results) == 1 else results

    async def events(self) -> AsyncIterator[str]:
        async for ev in gen.events(self.g):
            if ev.kind == "piece":
                chunk = {"index": ev.index, "content": ev.text, "tokens": ev.tokens, "stop": False, "id_slot": 0}
                if self.g.params.sampling.logprobs:
                    chunk["completion_probabilities"] = self.probs.llama(ev.tokens, ev.probs)
                yield gen.sse(chunk)
            elif ev.kind == "done":
                yield gen.sse(self.result(self.g.choices[ev.index]))
            elif ev.kind == "error":
                yield gen.sse(gen.stream_error(ev.error))


class OpenAIReply:
    """One OpenAI-shaped answer (completion or chat), whole or as chunks."""

    def __init__(self, e: Engine, g: Generation, *, chat: bool, stream: bool, include_usage: bool = False,
                 echo: list[str] | None = None):
        self.e, self.g, self.chat, self.echo = e, g, chat, echo
        self.include_usage = include_usage
        self.probs = _Probs(e, g.params.sampling.post_sampling_probs)
        obj = "chat.completion" if chat else "text_completion"
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                     "object": obj + (".chunk" if chat and stream else ""), "created": int(time.time()),
                     "model": e.name, "system_fingerprint": f"remat-{VERSION}"}

    def _logprobs(self, tokens: list[int], probs: list[TokenProbs], offset: int = 0) -> dict | None:
        if self.g.params.sampling.logprobs is None:
            return None
        return self.probs.chat(tokens, probs) if self.chat else self.probs.text(tokens, probs, offset)

    def _prefix(self, c: Choice) -> str:
        return self.echo[c.index // self.g.n] if self.echo is not None else ""

    def whole(self) -> dict:
        choices = []
        for c in self.g.choices:
            lp = self._logprobs(c.tokens, c.probs, len(self._prefix(c)))
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.content,
                                                              "refusal": None},
                                "logprobs": lp, "finish_reason": finish_reason(c)})
            else:
                choices.append({"index": c.index, "text": self._prefix(c) + c.content, "logprobs": lp,
                                "finish_reason": finish_reason(c)})
        return {**self.base, "choices": choices, "usage": self.g.usage(), "timings": self.g.timings()}

    def _chunk(self, index: int, text: str | None, finish: str | None, lp: dict | None = None,
               role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return {**self.base, "choices": [c], **({"usage": None} if self.include_usage else {})}

    async def events(self) -> AsyncIterator[str]:
        g, offsets = self.g, {c.index: len(self._prefix(c)) for c in self.g.choices}
        for c in g.choices:
            if self.chat:
                yield gen.sse(self._chunk(c.index, None, None, role=True))
            elif self.echo is not None:
                yield gen.sse(self._chunk(c.index, self._prefix(c), None))
        async for ev in gen.events(g):
            if ev.kind == "piece":
                lp = self._logprobs(ev.tokens, ev.probs, offsets[ev.index])
                offsets[ev.index] += len(ev.text)
                yield gen.sse(self._chunk(ev.index, ev.text, None, lp))
            elif ev.kind == "done":
                c = g.choices[ev.index]
                yield gen.sse({**self._chunk(c.index, None, finish_reason(c)), "timings": c.timings()})
            elif ev.kind == "end" and self.include_usage:
                yield gen.sse({**self.base, "choices": [], "usage": g.usage(), "timings": g.timings()})
            elif ev.kind == "error":
                yield gen.sse(gen.stream_error(ev.error))
        yield "data: [DONE]\n\n"

