"""POST /completion (llama.cpp) and /v1/completions (OpenAI), whole or as server-sent events."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from remat.base.settings import VERSION
from remat.serve import generation as gen
from remat.serve.body import openapi_body, reader
from remat.serve.engine import Engine, Generation, SamplingParams
from remat.serve.errors import responses
from remat.serve.schemas import CompletionRequest, CompletionResponse, CompletionsRequest, CompletionsResponse
from remat.serve.state import EngineDep

router = APIRouter(tags=["generation"])
ERRORS = responses(400, 503)
# Bodies read in a worker thread (`remat.serve.body`), as the served model bounds them.
CompletionBody = Annotated[CompletionRequest, Depends(reader(CompletionRequest))]
CompletionsBody = Annotated[CompletionsRequest, Depends(reader(CompletionsRequest))]


def _llama_result(e: Engine, body: CompletionRequest, params: SamplingParams, g: Generation) -> dict:
    prompt = body.prompt if isinstance(body.prompt, str) else e.tokenizer.decode(body.prompt)
    return {
        "index": 0, "content": g.content if not body.stream else "",
        "tokens": g.tokens if body.return_tokens else [], "id_slot": 0, "stop": True,
        "model": e.name, "tokens_predicted": g.n_predicted, "tokens_evaluated": g.n_prompt,
        "generation_settings": {**params.as_dict(), "seed": g.seed, "n_ctx": e.n_ctx, "model": e.name},
        "prompt": prompt, "has_new_line": "\n" in g.content, "truncated": g.truncated,
        "stop_type": g.stop_type, "stopping_word": g.stopping_word, "tokens_cached": 0, "timings": g.timings(),
    }


@router.post("/completion", response_model=CompletionResponse, responses={**gen.streams(CompletionResponse,
             "The completion"), **ERRORS}, openapi_extra=openapi_body(CompletionRequest))
@router.post("/completions", response_model=CompletionResponse, include_in_schema=False)
async def completion(e: EngineDep, body: CompletionBody, request: Request):
    """llama.cpp's completion. A client that hangs up stops the decoding (streaming or not)."""
    ids = await run_in_threadpool(e.prompt_ids, body.prompt)
    params = gen.sampling(body, body.n_predict, body.stop)
    g = await run_in_threadpool(e.generate, ids, params)
    if not body.stream:
        await gen.run_whole(g, request)
        return await run_in_threadpool(_llama_result, e, body, params, g)

    async def events():
        async for kind, val in gen.pieces(g):
            if kind == "piece":
                yield gen.sse({"index": 0, "content": val, "tokens": [], "stop": False, "id_slot": 0})
            elif kind == "end":
                yield gen.sse(_llama_result(e, body, params, g))
            else:
                yield gen.sse(gen.stream_error(val))

    return gen.event_stream(events())


class OpenAIReply:
    """One OpenAI-shaped answer (completion or chat), whole or as chunks."""

    def __init__(self, e: Engine, body, g: Generation, chat: bool):
        self.body, self.g, self.chat = body, g, chat
        obj = "chat.completion" if chat else "text_completion"
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                     "object": obj + (".chunk" if chat and body.stream else ""), "created": int(time.time()),
                     "model": e.name, "system_fingerprint": f"remat-{VERSION}"}

    def whole(self) -> dict:
        g = self.g
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": g.content}, "logprobs": None,
                      "finish_reason": gen.finish_reason(g)}
        else:
            choice = {"index": 0, "text": g.content, "logprobs": None, "finish_reason": gen.finish_reason(g)}
        return {**self.base, "choices": [choice], "usage": gen.usage(g), "timings": g.timings()}

    def chunk(self, piece: str | None, finish: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if piece is None else {"content": piece}
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {**self.base, "choices": [c]}

    async def events(self):
        g, options = self.g, self.body.stream_options
        if self.chat:
            yield gen.sse(self.chunk(None, None, first=True))
        async for kind, val in gen.pieces(g):
            if kind == "piece":
                yield gen.sse(self.chunk(val, None))
            elif kind == "end":
                yield gen.sse({**self.chunk(None, gen.finish_reason(g)), "timings": g.timings()})
                if options is not None and options.include_usage:
                    yield gen.sse({**self.base, "choices": [], "usage": gen.usage(g)})
            else:
                yield gen.sse(gen.stream_error(val))
        yield "data: [DONE]\n\n"


async def openai_answer(e: Engine, body, ids: list[int], max_tokens: int | None, chat: bool, request: Request):
    g = await run_in_threadpool(e.generate, ids, gen.sampling(body, max_tokens, body.stop))
    reply = OpenAIReply(e, body, g, chat)
    if body.stream:
        return gen.event_stream(reply.events())
    await gen.run_whole(g, request)
    return reply.whole()


@router.post("/v1/completions", response_model=CompletionsResponse,
             responses={**gen.streams(CompletionsResponse, "The completion"), **ERRORS},
             openapi_extra=openapi_body(CompletionsRequest))
async def v1_completions(e: EngineDep, body: CompletionsBody, request: Request):
    """OpenAI's text completion."""
    ids = await run_in_threadpool(e.prompt_ids, body.prompt)
    return await openai_answer(e, body, ids, body.max_tokens, False, request)
