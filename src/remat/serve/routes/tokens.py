"""POST /tokenize, /detokenize: the work runs in a worker thread, after a size check."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from remat.serve.body import openapi_body, reader
from remat.serve.errors import SafeJSONResponse, responses
from remat.serve.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from remat.serve.state import EngineDep

router = APIRouter(tags=["tokens"])
# Read in a worker thread, as the served model bounds them (the text's length, the token ids).
TokenizeBody = Annotated[TokenizeRequest, Depends(reader(TokenizeRequest))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(reader(DetokenizeRequest))]


@router.post("/tokenize", response_model=TokenizeResponse, responses=responses(400, 503),
             openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(e: EngineDep, body: TokenizeBody):
    """Token ids of `content` (special tokens parsed, as llama.cpp does); `with_pieces`: each id's text."""

    def work() -> SafeJSONResponse:
        ids = e.tokenize(body.content, body.add_special)
        if body.with_pieces:
            return SafeJSONResponse({"tokens": [{"id": t, "piece": e.tokenizer.decode([t])} for t in ids]})
        return SafeJSONResponse({"tokens": ids})

    return await run_in_threadpool(work)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=responses(400, 503),
             openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(e: EngineDep, body: DetokenizeBody):
    """The text of token ids."""
    return SafeJSONResponse({"content": await run_in_threadpool(e.detokenize, body.tokens)})
