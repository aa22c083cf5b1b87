"""POST /completion (llama.cpp) and /v1/completions (OpenAI), whole or as server-sent events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from remat.serve import generation as gen
from remat.serve.body import openapi_body, reader
from remat.serve.decoding import Generation
from remat.serve.engine import Engine
from remat.serve.errors import SafeJSONResponse, responses
from remat.serve.params import CompletionRequest, CompletionsRequest, prompts
from remat.serve.replies import LlamaReply, OpenAIReply
from remat.serve.schemas import CompletionAnswer, CompletionsResponse
from remat.serve.state import EngineDep

router = APIRouter(tags=["generation"])
ERRORS = responses(400, 503)
# Bodies read in a worker thread (`remat.serve.body`), as the served model bounds them.
CompletionBody = Annotated[CompletionRequest, Depends(reader(CompletionRequest))]
CompletionsBody = Annotated[CompletionsRequest, Depends(reader(CompletionsRequest))]


def _start(e: Engine, body: CompletionRequest | CompletionsRequest,
           logprobs: int | None) -> tuple[Generation, list[str]]:
    """The request's generation (checked, not started) and each prompt's text (a worker thread: it tokenizes)."""
    ids = [e.prompt_ids(p) for p in prompts(body.prompt)]
    g = e.generate(ids, gen.decoding(e, body, logprobs), body.choices)
    return g, [str(e.tokenizer.decode(x)) for x in ids]


@router.post("/completion", response_model=CompletionAnswer, responses={**gen.streams(
             CompletionAnswer, "The completion (a list of them for several prompts or choices)"), **ERRORS},
             openapi_extra=openapi_body(CompletionRequest))
@router.post("/completions", response_model=CompletionAnswer, include_in_schema=False)
async def completion(e: EngineDep, body: CompletionBody, request: Request):
    """llama.cpp's completion. A client that hangs up stops the decoding (streaming or not)."""
    n_probs = body.n_probs if body.n_probs is not None else body.logprobs
    g, texts = await run_in_threadpool(_start, e, body, n_probs or None)
    reply = LlamaReply(e, g, texts, bool(body.return_tokens), body.response_fields, bool(body.stream))
    if body.stream:
        return gen.event_stream(reply.events())
    await gen.whole(g, request)
    return SafeJSONResponse(await run_in_threadpool(reply.whole))


@router.post("/v1/completions", response_model=CompletionsResponse,
             responses={**gen.streams(CompletionsResponse, "The completion"), **ERRORS},
             openapi_extra=openapi_body(CompletionsRequest))
async def v1_completions(e: EngineDep, body: CompletionsBody, request: Request):
    """OpenAI's text completion (llama.cpp's fields taken too)."""
    n_probs = body.n_probs if body.n_probs is not None else body.logprobs
    g, texts = await run_in_threadpool(_start, e, body, n_probs)
    options = body.stream_options
    reply = OpenAIReply(e, g, chat=False, stream=bool(body.stream), echo=texts if body.echo else None,
                        include_usage=bool(options and options.include_usage))
    if body.stream:
        return gen.event_stream(reply.events())
    await gen.whole(g, request)
    return SafeJSONResponse(await run_in_threadpool(reply.whole))
