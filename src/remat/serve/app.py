"""`remat serve`: an HTTP server that serves a model and fine-tunes it, llama.cpp's and OpenAI's shapes.

Routes (shared/DESIGN.md §7):
  GET  /health, /props, /v1/models, /metrics
  POST /completion (llama.cpp), /v1/completions, /v1/chat/completions (OpenAI); SSE with "stream": true
  POST /tokenize, /detokenize
  POST /train, GET /train, GET /train/{id}, GET /train/{id}/events (SSE), DELETE /train/{id},
  POST /train/{id}/resume
  GET/POST /lora-adapters (llama.cpp's shape)

Every error is `{"error": {"code", "message", "type", ...}}` with llama.cpp's types; never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import sys
import threading
import time
import uuid
import warnings
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from remat.serve import page
from remat.serve.engine import Engine, EngineError, Generation, SamplingParams

__all__ = ["create_app", "main"]

log = logging.getLogger("remat.serve")

DEFAULT_MAX_BODY = 64 << 20
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/v1/models", "/models"})
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error", 501: "not_supported_error",
               503: "unavailable_error"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---------------------------------------------------------------------------------------------------------
# errors


def error_body(status: int, message: str, type: str | None = None, code: int | str | None = None,
               extra: dict | None = None) -> dict:
    err = {"code": status if code is None else code, "message": message,
           "type": type or ERROR_TYPES.get(status, "server_error")}
    for k, v in (extra or {}).items():
        err.setdefault(k, v)
    return {"error": err}


def error_response(status: int, message: str, type: str | None = None, code: int | str | None = None,
                   extra: dict | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type, code, extra), status_code=status, headers=headers)


def _job_error_parts(e: Exception) -> tuple[int, dict]:
    status = int(getattr(e, "status", 400))
    body = error_body(status, str(getattr(e, "message", None) or e), getattr(e, "type", None),
                      getattr(e, "code", None), getattr(e, "extra", None))
    return status, body


_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _where(loc: tuple) -> str:
    # Drop "body" and pydantic's union-member tags ("str", "list[constrained-int]") from the location.
    parts = [str(p) for p in loc if p != "body"
             and not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p.startswith("constrained")))]
    return ".".join(parts)


def validation_message(errors: list[dict]) -> str:
    """One line naming each bad field, from pydantic's errors."""
    by_field: dict[str, list[str]] = {}
    for err in errors:
        kind, where = err.get("type", ""), _where(tuple(err.get("loc", ())))
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"malformed JSON in the request body: {ctx.get('error', 'cannot parse it')}"
        if not where:
            msg = "the request body must be a JSON object" if kind in ("model_attributes_type", "dict_type") \
                else "the request body must be a JSON array" if kind == "list_type" \
                else f"the request body: {err.get('msg', 'invalid value')}"
        elif kind == "extra_forbidden":
            msg = f"unknown field '{where}'"
        elif kind == "missing":
            msg = f"missing field '{where}'"
        else:
            msg = err.get("msg", "invalid value")
        by_field.setdefault(where, [])
        if msg not in by_field[where]:
            by_field[where].append(msg)
    msgs = []
    for where, texts in list(by_field.items())[:5]:
        if texts[0].startswith(("unknown field", "missing field", "the request body")):
            msgs.append(texts[0])
        else:
            msgs.append(f"field '{where}': " + " or ".join(t[0].lower() + t[1:] for t in texts))
    more = f" (and {len(by_field) - 5} more)" if len(by_field) > 5 else ""
    return "; ".join(msgs) + more


# ---------------------------------------------------------------------------------------------------------
# request bodies


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LoraScale(Body):
    id: Annotated[int, Field(ge=0)]
    scale: float


Stop = str | list[str] | None
Temperature = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(ge=0, le=1)]


class CompletionRequest(Body):
    """llama.cpp's /completion."""

    prompt: str | list[Annotated[int, Field(ge=0)]]
    n_predict: Annotated[int, Field(ge=-1)] = -1
    temperature: Temperature = 0.8
    top_k: Annotated[int, Field(ge=0)] = 40
    top_p: Probability = 0.95
    min_p: Probability = 0.05
    seed: Annotated[int, Field(ge=-1, le=2**63 - 1)] = -1
    stop: list[str] = []
    stream: bool = False
    lora: list[LoraScale] | None = None
    cache_prompt: bool = True  # accepted for llama.cpp clients; every request evaluates its prompt
    return_tokens: bool = False


class StreamOptions(Body):
    include_usage: bool = False


class OpenAIParams(Body):
    model: str | None = None  # accepted and ignored: one model is served
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Temperature = 0.8
    top_p: Probability = 0.95
    top_k: Annotated[int, Field(ge=0)] = 40
    min_p: Probability = 0.05
    seed: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    user: str | None = None
    lora: list[LoraScale] | None = None


class CompletionsRequest(OpenAIParams):
    prompt: str | list[Annotated[int, Field(ge=0)]]


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(OpenAIParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None


class TokenizeRequest(Body):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Body):
    tokens: list[Annotated[int, Field(ge=0)]]


class TrainRequest(BaseModel):
    """A training job. The job manager checks each value and names the bad field (`param`)."""

    model_config = ConfigDict(extra="forbid")

    data: object = Field(description='records: [{"text"}, {"messages": [...]}, or {"prompt", "completion"}]')
    name: object = Field(None, description="a name for the job and its adapter (at most 64 characters)")
    epochs: object = Field(None, description="passes over the data (default 1)")
    steps: object = Field(None, description="stop after this many optimizer steps")
    ctx: object = Field(None, description="tokens per window (default min(256, the model's maximum))")
    batch: object = Field(None, description="windows per step (default 1)")
    accumulate: object = Field(None, description="batches per optimizer step (default 1)")
    lr: object = Field(None, description="learning rate (default 1e-3 with LoRA, 1e-4 for full fine-tuning)")
    seed: object = Field(None, description="seed of the adapter's initial weights and the data order (default 0)")
    recompute: object = Field(None, description='true, false or "auto" (default "auto": only when needed to fit)')
    path: object = Field(None, description='"ubatch" (one graph per window) or "walk" (chunks over a KV cache)')
    ubatch: object = Field(None, description="walk: tokens per chunk")
    loss_chunk: object = Field(None, description="tokens per piece of the loss head; 0: one piece")
    save_every: object = Field(None, description="optimizer steps between checkpoints (resume continues from one)")
    lora: object = Field(None, description="{r, alpha, dropout, targets}, or false for full fine-tuning")
    model: object = Field(None, description="ignored: the server trains the model it serves")


# ---------------------------------------------------------------------------------------------------------
# middleware (pure ASGI: they run before FastAPI reads anything)


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """With keys set, every path but the public ones needs `Authorization: Bearer KEY` or `X-Api-Key: KEY`."""

    def __init__(self, app, keys: list[str]):
        self.app, self.keys = app, [k.encode() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = None
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        elif b"x-api-key" in headers:
            given = headers[b"x-api-key"].strip()
        if given is None or not any(hmac.compare_digest(given, k) for k in self.keys):
            msg = "Invalid API Key" if given is not None else "Missing API key: send Authorization: Bearer KEY"
            return await _send_json(send, 401, error_body(401, msg, "authentication_error"),
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses bodies over `limit` bytes with 413, by Content-Length and by the bytes that actually arrive."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        too_big = error_body(413, f"the request body is larger than the limit of {self.limit} bytes "
                                  "(--max-body)")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await _send_json(send, 400, error_body(400, "Content-Length is not a number"))
            if n > self.limit:
                return await _send_json(send, 413, too_big, [(b"connection", b"close")])
        # Read the whole body now (it is at most `limit` bytes), counting, then hand it on.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_json(send, 413, too_big, [(b"connection", b"close")])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and not headers.get(b"content-type", b"").split(b";")[0].strip().endswith(b"json"):
            # Every body here is JSON: read it as JSON whatever the client called it (curl -d says a form).
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, for streaming responses

        return await self.app(scope, replay, send)


# ---------------------------------------------------------------------------------------------------------
# the server's state


class Server:
    def __init__(self, *, model: str | None, parallel: int, max_slowdown_ppm: int, memory_budget: int | None,
                 state_dir: Path, n_ctx: int | None, api_keys: list[str], max_body: int,
                 on_load_error=None):
        self.model_spec, self.parallel, self.max_slowdown_ppm = model, parallel, max_slowdown_ppm
        self.memory_budget, self.state_dir, self.n_ctx = memory_budget, Path(state_dir), n_ctx
        self.api_keys, self.max_body, self.on_load_error = api_keys, max_body, on_load_error
        self.scheduler = None
        self.jobs = None
        self.engine: Engine | None = None
        self.started = time.time()
        self.ready = threading.Event()  # the model is loaded and the job state is open
        self.load_error: str | None = None

    def start(self) -> None:
        from remat.serve.scheduler import Scheduler

        self.scheduler = Scheduler(max_slowdown_ppm=self.max_slowdown_ppm)
        self.engine = Engine(self.model_spec, parallel=self.parallel, n_ctx=self.n_ctx, scheduler=self.scheduler,
                             adapters=self.adapters)
        threading.Thread(target=self._load, name="remat-load", daemon=True).start()

    def adapters(self) -> list[dict]:
        return self.jobs.adapters() if self.jobs is not None else []

    def _load(self) -> None:
        """Load the model, then open the job state (its checks use the served model's tokenizer)."""
        from remat.serve.jobs import JobManager

        try:
            self.engine.load()
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.jobs = JobManager(model=self.model_spec, state_dir=self.state_dir, scheduler=self.scheduler,
                                   memory_budget=self.memory_budget, tokenizer=self.engine.tokenizer)
            self.ready.set()
            log.info("model %s loaded (n_ctx %d)", self.engine.name, self.engine.n_ctx)
        except Exception as e:  # noqa: BLE001 - reported by /health; the command line stops the server
            self.load_error = self.engine.load_error or f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            log.error("cannot start: %s", self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def stop(self) -> None:
        if self.jobs is not None:
            self.jobs.close()

    def check_ready(self) -> None:
        if not self.ready.is_set():
            if self.load_error:
                raise EngineError(500, f"the server failed to start: {self.load_error}", "server_error")
            raise EngineError(503, "Loading model", "unavailable_error")

    def ready_engine(self) -> Engine:
        self.check_ready()
        return self.engine

    def ready_jobs(self):
        self.check_ready()
        return self.jobs


# ---------------------------------------------------------------------------------------------------------
# helpers for generation routes


def _sse(data: dict | str, event: str | None = None, id: int | None = None) -> str:
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append("data: " + (data if isinstance(data, str) else json.dumps(data)))
    return "\n".join(lines) + "\n\n"


def _stops(stop: Stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _params(body, n_predict: int | None, stop: list[str]) -> SamplingParams:
    seed = getattr(body, "seed", None)
    return SamplingParams(
        n_predict=-1 if n_predict is None else n_predict,
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        seed=-1 if seed is None else seed, stop=stop,
        lora=[x.model_dump() for x in body.lora] if body.lora is not None else None,
    )


def _finish_reason(g: Generation) -> str:
    return "length" if g.stop_type == "limit" else "stop"


def _usage(g: Generation) -> dict:
    return {"prompt_tokens": g.n_prompt, "completion_tokens": g.n_predicted,
            "total_tokens": g.n_prompt + g.n_predicted}


async def _pieces(g: Generation):
    """Run the generation in its own thread; yield ("piece", text) ... then ("end", None) or ("error", e).

    The client going away cancels the generation at the next token.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone: the server is shutting down
            g.cancel.set()

    def work() -> None:
        try:
            for piece in g:
                put(("piece", piece))
            put(("end", None))
        except BaseException as e:  # noqa: BLE001 - reported to the client as an error event
            put(("error", e))

    threading.Thread(target=work, name="remat-decode", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            yield item
            if item[0] != "piece":
                return
    finally:
        g.cancel.set()


def _stream_error(e: BaseException) -> dict:
    if isinstance(e, EngineError):
        return error_body(e.status, e.message, e.type, e.code, e.extra)
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return error_body(500, f"generation failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                      "server_error")


# ---------------------------------------------------------------------------------------------------------
# the app


def create_app(*, model: str | None = None, parallel: int = 1, api_keys: list[str] | None = None,
               max_slowdown_ppm: int = 50_000, memory_budget: int | None = None,
               state_dir: str | Path = "remat-state", max_body: int = DEFAULT_MAX_BODY, n_ctx: int | None = None,
               on_load_error=None) -> FastAPI:
    """The FastAPI app; the options are `remat serve`'s. `model`: a spec for `load_model` (None: the embedded
    default). The model loads in a background thread when the app starts (lifespan): /health answers 503
    until it is ready. `on_load_error(message)` is called if loading fails."""
    srv = Server(model=model, parallel=parallel, max_slowdown_ppm=max_slowdown_ppm, memory_budget=memory_budget,
                 state_dir=Path(state_dir), n_ctx=n_ctx, api_keys=list(api_keys or []), max_body=max_body,
                 on_load_error=on_load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Requests waiting for a decode slot each hold a worker thread: allow many more than the 40 default.
        anyio.to_thread.current_default_thread_limiter().total_tokens = max(64, 16 * parallel)
        srv.start()
        try:
            yield
        finally:
            await run_in_threadpool(srv.stop)
            log.info("stopped")

    app = FastAPI(title="remat", version="0.1.0", lifespan=lifespan,
                  description="Serve a model and fine-tune it: llama.cpp's and OpenAI's API shapes.")
    app.state.server = srv
    app.add_middleware(BodyLimitMiddleware, limit=max_body)
    app.add_middleware(ApiKeyMiddleware, keys=list(api_keys or []))  # added last: runs first
    page.install(app)  # the web page at /, served without a key (its middleware runs before the key check)

    # -- errors ---------------------------------------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        return error_response(400, validation_message(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineError)
    async def on_engine(request: Request, exc: EngineError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.extra)

    @app.exception_handler(Exception)
    async def on_any(request: Request, exc: Exception):
        if type(exc).__name__ == "JobError":
            status, body = _job_error_parts(exc)
            return JSONResponse(body, status_code=status)
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                              "server_error")

    jobs = srv.ready_jobs

    async def call_jobs(fn, *args):
        """Job manager calls in a worker thread; its JobError becomes the error body it describes."""
        try:
            return await run_in_threadpool(fn, *args)
        except Exception as e:
            if type(e).__name__ == "JobError":
                status, body = _job_error_parts(e)
                raise _Respond(JSONResponse(body, status_code=status)) from None
            raise

    @app.exception_handler(_Respond)
    async def on_respond(request: Request, exc: _Respond):
        return exc.response

    # -- health, props, models, metrics ---------------------------------------------------------------

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health():
        if srv.ready.is_set():
            return {"status": "ok"}
        if srv.load_error:
            return error_response(500, f"the server failed to start: {srv.load_error}", "server_error")
        return error_response(503, "Loading model", "unavailable_error")

    @app.get("/props")
    async def props():
        e = srv.ready_engine()
        return {
            "model": e.name,
            "model_path": srv.model_spec or "default",
            "n_ctx": e.n_ctx,
            "total_slots": srv.parallel,
            "parallel": srv.parallel,
            "max_slowdown_ppm": srv.max_slowdown_ppm,
            "memory_budget": srv.memory_budget,
            "default_generation_settings": {"n_ctx": e.n_ctx, "params": SamplingParams().as_dict()},
            "chat_template": e.tokenizer.chat_template,
            "build_info": "remat 0.1.0",
        }

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models():
        e = srv.engine
        name = e.name if e is not None else (srv.model_spec or "default")
        meta = {"n_ctx": e.n_ctx} if srv.ready.is_set() else {}
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(srv.started),
                                            "owned_by": "remat", "meta": meta}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(await run_in_threadpool(_metrics_text, srv),
                                 media_type="text/plain; version=0.0.4")

    # -- generation -----------------------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        e = srv.ready_engine()
        ids = await run_in_threadpool(e.tokenize, body.content, body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": e.tokenizer.decode([t])} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        e = srv.ready_engine()
        return {"content": await run_in_threadpool(e.detokenize, body.tokens)}

    @app.post("/completion")
    @app.post("/completions", include_in_schema=False)
    async def completion(body: CompletionRequest):
        e = srv.ready_engine()
        ids = await run_in_threadpool(e.prompt_ids, body.prompt)
        params = _params(body, body.n_predict, list(body.stop))
        g = await run_in_threadpool(e.generate, ids, params)
        prompt_text = body.prompt if isinstance(body.prompt, str) else e.tokenizer.decode(body.prompt)

        def final() -> dict:
            return {
                "index": 0, "content": g.content if not body.stream else "",
                "tokens": g.tokens if body.return_tokens else [], "id_slot": 0, "stop": True,
                "model": e.name, "tokens_predicted": g.n_predicted, "tokens_evaluated": g.n_prompt,
                "generation_settings": {**params.as_dict(), "seed": g.seed, "n_ctx": e.n_ctx,
                                        "model": e.name},
                "prompt": prompt_text, "has_new_line": "\n" in g.content, "truncated": g.truncated,
                "stop_type": g.stop_type, "stopping_word": g.stopping_word, "tokens_cached": 0,
                "timings": g.timings(),
            }

        if not body.stream:
            await run_in_threadpool(g.run)
            return final()

        async def events():
            async for kind, val in _pieces(g):
                if kind == "piece":
                    yield _sse({"index": 0, "content": val, "tokens": [], "stop": False, "id_slot": 0})
                elif kind == "end":
                    yield _sse(final())
                else:
                    yield _sse(_stream_error(val))

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def openai_generate(body: OpenAIParams, ids: list[int], max_tokens: int | None,
                              chat: bool):
        e = srv.ready_engine()
        g = await run_in_threadpool(e.generate, ids, _params(body, max_tokens, _stops(body.stop)))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "object": obj + (".chunk" if chat and body.stream else ""), "created": created,
                "model": e.name, "system_fingerprint": "remat-0.1.0"}

        if not body.stream:
            await run_in_threadpool(g.run)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": g.content},
                          "logprobs": None, "finish_reason": _finish_reason(g)}
            else:
                choice = {"index": 0, "text": g.content, "logprobs": None, "finish_reason": _finish_reason(g)}
            return {**base, "choices": [choice], "usage": _usage(g), "timings": g.timings()}

        def chunk(piece: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if first:
                    delta = {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [c]}

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events():
            if chat:
                yield _sse(chunk(None, None, first=True))
            async for kind, val in _pieces(g):
                if kind == "piece":
                    yield _sse(chunk(val, None))
                elif kind == "end":
                    last = chunk(None, _finish_reason(g))
                    last["timings"] = g.timings()
                    yield _sse(last)
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(g)})
                else:
                    yield _sse(_stream_error(val))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/completions")
    async def v1_completions(body: CompletionsRequest):
        e = srv.ready_engine()
        ids = await run_in_threadpool(e.prompt_ids, body.prompt)
        return await openai_generate(body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def v1_chat(body: ChatRequest):
        e = srv.ready_engine()
        messages = []
        for m in body.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(p.text for p in m.content)
            messages.append({"role": m.role, "content": content or ""})
        _, ids = await run_in_threadpool(e.chat_prompt, messages)
        if not ids:
            raise EngineError(400, "the chat prompt is empty")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await openai_generate(body, ids, max_tokens, chat=True)

    # -- adapters ---------------------------------------------------------------------------------------

    @app.get("/lora-adapters")
    async def get_adapters():
        return await call_jobs(jobs().adapters)

    @app.post("/lora-adapters")
    async def set_adapters(body: list[LoraScale]):
        return await call_jobs(jobs().set_scales, [x.model_dump() for x in body])

    # -- training ---------------------------------------------------------------------------------------

    @app.post("/train", status_code=202)
    async def train(body: TrainRequest):
        return JSONResponse(await call_jobs(jobs().submit, body.model_dump(exclude_unset=True)),
                            status_code=202)

    @app.get("/train")
    async def train_list():
        return {"object": "list", "data": await call_jobs(jobs().list)}

    @app.get("/train/{job_id}")
    async def train_get(job_id: str):
        return await call_jobs(jobs().get, job_id)

    @app.delete("/train/{job_id}")
    async def train_cancel(job_id: str):
        return await call_jobs(jobs().cancel, job_id)

    @app.post("/train/{job_id}/resume", status_code=202)
    async def train_resume(job_id: str):
        return JSONResponse(await call_jobs(jobs().resume, job_id), status_code=202)

    @app.get("/train/{job_id}/events")
    async def train_events(job_id: str, request: Request, after: int | None = None, stream: bool = True):
        """Progress as server-sent events (`id`, `event`, `data`); `Last-Event-ID` or `?after=N` resumes
        after event N. The stream ends after the job's last event. `?stream=false`: one JSON list."""
        manager = jobs()
        header = request.headers.get("last-event-id")
        if header is not None:
            try:
                after = int(header.strip())
            except ValueError:
                raise EngineError(400, f"Last-Event-ID '{header}' is not an event id (an integer)") from None
        after = -1 if after is None else after
        await call_jobs(manager.get, job_id)  # 404 for an unknown job, before the stream starts
        if not stream:
            return {"object": "list", "data": await call_jobs(manager.events_since, job_id, after)}

        async def events():
            last = after
            yield "retry: 1000\n\n"
            while True:
                status = (await run_in_threadpool(manager.get, job_id)).get("status")
                batch = await run_in_threadpool(manager.wait_events, job_id, last,
                                                0.5 if status in TERMINAL_STATUSES else 10.0)
                for ev in batch:
                    last = int(ev["id"])
                    yield _sse(ev.get("data", {}), event=ev.get("event", "message"), id=last)
                if status in TERMINAL_STATUSES and not batch:
                    return
                if not batch:
                    if await request.is_disconnected():
                        return
                    yield ": keep-alive\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    return app


class _Respond(Exception):
    """Carries a ready response out of a route (used for the job manager's errors)."""

    def __init__(self, response: Response):
        self.response = response


# ---------------------------------------------------------------------------------------------------------
# metrics


def _metrics_text(srv: Server) -> str:
    out: list[str] = []

    def metric(name: str, kind: str, help: str, value, labels: str = "") -> None:
        if value is None:
            return
        if not any(line.startswith(f"# TYPE remat_{name} ") for line in out):
            out.append(f"# HELP remat_{name} {help}")
            out.append(f"# TYPE remat_{name} {kind}")
        out.append(f"remat_{name}{labels} {value!r}" if isinstance(value, float) else
                   f"remat_{name}{labels} {int(value)}")

    e = srv.engine
    st = dict(e.stats) if e is not None else {}
    metric("requests_total", "counter", "Generation requests finished.", st.get("requests", 0))
    metric("prompt_tokens_total", "counter", "Prompt tokens evaluated.", st.get("prompt_tokens", 0))
    metric("tokens_predicted_total", "counter", "Tokens generated.", st.get("tokens_predicted", 0))
    decode_s = st.get("decode_seconds", 0.0)
    metric("decode_tokens_per_second", "gauge", "Generated tokens per second of decoding, per request.",
           float(st.get("tokens_predicted", 0) / decode_s) if decode_s else 0.0)
    metric("requests_processing", "gauge", "Requests decoding now (busy slots).", e.slots.busy if e else 0)
    metric("requests_deferred", "gauge", "Requests waiting for a slot.", e.slots.waiting if e else 0)
    metric("slots_total", "gauge", "Requests that may decode at once (--parallel).", srv.parallel)
    metric("model_loaded", "gauge", "1 once the model is loaded.", int(bool(e and e.ready.is_set())))

    if srv.scheduler is not None:
        try:
            s = srv.scheduler.stats()
        except Exception:  # noqa: BLE001 - metrics never fail because a part does
            s = {}
        metric("training_chunks_total", "counter", "Training chunks run.", s.get("chunks"))
        metric("training_window_p50_seconds", "gauge", "Median time a decode could wait for a training chunk.",
               _num(s.get("window_p50")))
        metric("training_window_p95_seconds", "gauge", "95th percentile of a training chunk's window.",
               _num(s.get("window_p95")))
        metric("training_waited_seconds_total", "counter", "Time training yielded to decoding.",
               _num(s.get("waited_seconds")))
        metric("slowdown_ppm", "gauge", "Measured decode slowdown from training, parts per million.",
               _num(s.get("slowdown_ppm")))
        metric("max_slowdown_ppm", "gauge", "Allowed decode slowdown (--max-slowdown-ppm).",
               _num(s.get("max_slowdown_ppm", srv.max_slowdown_ppm)))

    if srv.jobs is not None:
        try:
            job_list = srv.jobs.list()
        except Exception:  # noqa: BLE001
            job_list = []
        by_status: dict[str, int] = {}
        steps = 0
        for j in job_list:
            by_status[j.get("status", "unknown")] = by_status.get(j.get("status", "unknown"), 0) + 1
            steps += _job_steps(j)
        for status in sorted(by_status):
            metric("training_jobs", "gauge", "Training jobs by status.", by_status[status], f'{{status="{status}"}}')
        metric("training_steps_total", "counter", "Optimizer steps taken by all training jobs.", steps)
        current = next((j for j in job_list if j.get("status") == "running"), None)
        if current is None and job_list:
            current = job_list[-1]  # the newest
        if current is not None:
            losses = current.get("losses") or []
            last_loss = current.get("loss", losses[-1] if losses else None)
            metric("training_last_loss", "gauge", "Loss of the last step of the running (or last) job.",
                   _num(last_loss))
            plan = current.get("plan") or {}
            for k in ("total", "graph"):
                metric("training_planned_bytes", "gauge", "Planned memory of the running (or last) job.",
                       _num(plan.get(k)) if isinstance(plan, dict) else None, f'{{kind="{k}"}}')
            measured = current.get("measured") or {}
            if isinstance(measured, dict):
                for k, v in measured.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        metric("training_measured_bytes", "gauge",
                               "Measured memory of the running (or last) job.", v, f'{{kind="{k}"}}')
    return "\n".join(out) + "\n"


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _job_steps(job: dict) -> int:
    for key in ("step", "steps_done", "steps"):
        v = job.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return len(job.get("losses") or [])


# ---------------------------------------------------------------------------------------------------------
# command line


def main(args: argparse.Namespace) -> int:
    """Run the server until interrupted. 0 on a clean stop, 2 for a bad model or setting, 1 if loading fails."""
    import uvicorn

    from remat.models import ModelError, load_config

    try:
        config = load_config(args.model)  # a bad spec fails now, not in the background
    except ModelError as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    max_ctx = getattr(config, "max_position_embeddings", None)
    if args.ctx is not None and max_ctx is not None and args.ctx > max_ctx:
        print(f"remat: error: --ctx {args.ctx} is above the model's maximum context {max_ctx}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation chatter, not for users
    logging.basicConfig(level=logging.WARNING, format="remat serve: %(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)  # our own lines; libraries' INFO chatter (gguf writer) stays out
    failed: list[str] = []
    server_box: list[uvicorn.Server] = []

    def on_load_error(message: str) -> None:
        failed.append(message)
        if server_box:
            server_box[0].should_exit = True

    app = create_app(model=args.model, parallel=args.parallel, api_keys=args.api_key,
                     max_slowdown_ppm=args.max_slowdown_ppm, memory_budget=args.memory_budget,
                     state_dir=args.state_dir, max_body=args.max_body, n_ctx=args.ctx, on_load_error=on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))
    server_box.append(server)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this address can use it", args.host)
    log.info("listening on http://%s:%d", args.host, args.port)
    server.run()
    if failed:
        print(f"remat: error: cannot load the model: {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from remat.cli import main as cli_main

    sys.exit(cli_main(["serve", *sys.argv[1:]]))
