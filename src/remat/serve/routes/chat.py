"""POST /v1/chat/completions (OpenAI), whole or as server-sent events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from remat.serve import generation as gen
from remat.serve.body import openapi_body, reader
from remat.serve.errors import ApiError, responses
from remat.serve.routes.completions import openai_answer
from remat.serve.schemas import ChatRequest, ChatResponse
from remat.serve.state import EngineDep

router = APIRouter(tags=["generation"])
ChatBody = Annotated[ChatRequest, Depends(reader(ChatRequest))]  # read in a worker thread


@router.post("/v1/chat/completions", response_model=ChatResponse,
             responses={**gen.streams(ChatResponse, "The answer"), **responses(400, 503)},
             openapi_extra=openapi_body(ChatRequest))
@router.post("/chat/completions", response_model=ChatResponse, include_in_schema=False)
async def v1_chat(e: EngineDep, body: ChatBody, request: Request):
    """OpenAI's chat completion, through the model's chat template."""
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": content or ""})
    _, ids = await run_in_threadpool(e.chat_prompt, messages)
    if not ids:
        raise ApiError(400, "the chat prompt is empty")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await openai_answer(e, body, ids, max_tokens, True, request)
