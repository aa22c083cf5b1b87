"""POST /v1/chat/completions (OpenAI, with llama.cpp's fields), whole or as server-sent events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from remat.serve import generation as gen
from remat.serve.body import openapi_body, reader
from remat.serve.decoding import Generation
from remat.serve.engine import Engine
from remat.serve.errors import ApiError, SafeJSONResponse, invalid, responses
from remat.serve.params import ChatRequest
from remat.serve.replies import OpenAIReply
from remat.serve.schemas import ChatResponse
from remat.serve.state import EngineDep

router = APIRouter(tags=["generation"])
ChatBody = Annotated[ChatRequest, Depends(reader(ChatRequest))]  # read in a worker thread
# apply_chat_template's own arguments: a request sets them through its fields, not as template variables
RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
            "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
            "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _messages(body: ChatRequest) -> list[dict]:
    out = []
    for m in body.messages:
        d = {"role": m.role, "content": m.text()}
        d.update({k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id),
                                    ("reasoning_content", m.reasoning_content)) if v is not None})
        out.append(d)
    return out


def _template(body: ChatRequest) -> tuple[bool, bool, dict]:
    """add_generation_prompt, continue_final_message and the template's variables, as llama.cpp sets them: a
    conversation that ends with an assistant message continues it unless the request says otherwise."""
    variables = dict(body.chat_template_kwargs or {})
    clash = sorted(RESERVED & set(variables))
    if clash:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs: '{clash[0]}' is not a template variable "
                                              "(the request's own fields set it)")
    if body.reasoning_effort == "none":
        variables["enable_thinking"] = False
    elif body.reasoning_effort is not None:
        variables["reasoning_effort"] = body.reasoning_effort
    last = body.messages[-1].role == "assistant"
    cont = body.continue_final_message if body.continue_final_message is not None else (
        last and body.add_generation_prompt is not True)
    add = body.add_generation_prompt if body.add_generation_prompt is not None else not cont
    if cont and add:
        raise ApiError(400, "add_generation_prompt and continue_final_message cannot both be true")
    if cont and not last:
        raise invalid("continue_final_message", "continue_final_message: the last message is not the assistant's")
    return add, cont, variables


def _start(e: Engine, body: ChatRequest) -> Generation:
    """The request's generation, checked, not started (a worker thread: it renders and tokenizes)."""
    add, cont, variables = _template(body)
    _, ids = e.chat_prompt(_messages(body), add_generation_prompt=add, continue_final_message=cont,
                           variables=variables)
    if not ids:
        raise ApiError(400, "the chat prompt is empty")
    k = (body.top_logprobs or 0) if body.logprobs else (body.n_probs or None)
    return e.generate([ids], gen.decoding(e, body, k), body.choices)


@router.post("/v1/chat/completions", response_model=ChatResponse,
             responses={**gen.streams(ChatResponse, "The answer"), **responses(400, 503)},
             openapi_extra=openapi_body(ChatRequest))
@router.post("/chat/completions", response_model=ChatResponse, include_in_schema=False)
async def v1_chat(e: EngineDep, body: ChatBody, request: Request):
    """OpenAI's chat completion, through the model's chat template."""
    g = await run_in_threadpool(_start, e, body)
    options = body.stream_options
    reply = OpenAIReply(e, g, chat=True, stream=bool(body.stream),
                        include_usage=bool(options and options.include_usage))
    if body.stream:
        return gen.event_stream(reply.events())
    await gen.whole(g, request)
    return SafeJSONResponse(await run_in_threadpool(reply.whole))
