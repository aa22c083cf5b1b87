"""GET /health, /props, /v1/models, /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from remat.base.settings import VERSION
from remat.serve.decoding import Params
from remat.serve.errors import error_response, responses
from remat.serve.metrics import metrics_text
from remat.serve.schemas import Health, ModelList, Props
from remat.serve.state import EngineDep, ServerDep

router = APIRouter(tags=["server"])


@router.get("/health", response_model=Health, responses=responses(500, 503))
@router.get("/v1/health", response_model=Health, include_in_schema=False)
async def health(srv: ServerDep):
    """`{"status": "ok"}` once the model is loaded; 503 while it loads."""
    if srv.ready.is_set():
        return {"status": "ok"}
    if srv.load_error:
        return error_response(500, f"the server failed to start: {srv.load_error}", "server_error")
    return error_response(503, "Loading model", "unavailable_error")


@router.get("/props", response_model=Props, responses=responses(503))
async def props(srv: ServerDep, e: EngineDep):
    """The served model and the server's settings (llama.cpp's /props)."""
    return {
        "model": e.name,
        "model_path": srv.model_spec or "default",
        "n_ctx": e.n_ctx,
        "total_slots": srv.parallel,
        "parallel": srv.parallel,
        "max_slowdown_ppm": srv.max_slowdown_ppm,
        "memory_budget": srv.memory_budget,
        "default_generation_settings": {"n_ctx": e.n_ctx, "params": Params(n_predict=e.n_predict).as_dict()},
        "chat_template": e.tokenizer.chat_template,
        "build_info": f"remat {VERSION}",
    }


@router.get("/v1/models", response_model=ModelList)
@router.get("/models", response_model=ModelList, include_in_schema=False)
async def models(srv: ServerDep):
    """The one served model (OpenAI's shape)."""
    e = srv.engine
    name = e.name if e is not None else (srv.model_spec or "default")
    meta = {"n_ctx": e.n_ctx} if e is not None and srv.ready.is_set() else {}
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(srv.started),
                                        "owned_by": "remat", "meta": meta}]}


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text format"}})
async def metrics(srv: ServerDep):
    """Prometheus metrics: requests, tokens, slots, training jobs, the scheduler's slowdown."""
    return PlainTextResponse(await run_in_threadpool(metrics_text, srv), media_type="text/plain; version=0.0.4")
