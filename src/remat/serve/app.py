"""`remat serve`: an HTTP server that serves a model and fine-tunes it, llama.cpp's and OpenAI's shapes.

Routes (one router per feature, under `remat.serve.routes`):
  GET  /health, /props, /v1/models, /metrics
  POST /completion (llama.cpp), /v1/completions, /v1/chat/completions (OpenAI); SSE with "stream": true
  POST /tokenize, /detokenize
  POST /train/plan, POST /train, GET /train, GET /train/{id}, GET /train/{id}/events (SSE), DELETE /train/{id},
  POST /train/{id}/resume
  GET/POST /lora-adapters (llama.cpp's shape)
  GET /, /ui/... the web page (`remat.serve.page`)

Every error is `{"error": {"code", "message", "type", ...}}` with llama.cpp's types; never a traceback.
The OpenAPI document (`/openapi.json`) is made from the same pydantic models that check the requests.
"""

from __future__ import annotations

import logging
import sys
import warnings
from contextlib import asynccontextmanager
from pathlib import Path

import anyio.to_thread
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from remat.base.settings import DEFAULT_SLOWDOWN_PPM, VERSION, ServeSettings
from remat.serve import errors, openapi, page, params
from remat.serve.middleware import BODY_TIMEOUT, ApiKeyMiddleware, BodyLimitMiddleware, HeadMiddleware
from remat.serve.routes import ROUTERS
from remat.serve.state import Server

__all__ = ["create_app", "main"]

log = logging.getLogger("remat.serve")

SWITCH_INTERVAL = 0.001  # seconds
SERVE = {name: f.default for name, f in ServeSettings.model_fields.items()}  # `remat serve`'s defaults, once


@asynccontextmanager
async def lifespan(app: FastAPI):
    srv: Server = app.state.server
    # Requests waiting for a decode slot each hold a worker thread: allow many more than the 40 default.
    anyio.to_thread.current_default_thread_limiter().total_tokens = max(64, 16 * srv.parallel)
    # A worker thread busy in Python (a large body being checked, a job's bookkeeping) hands the GIL to the
    # event loop within this interval (CPython's default 5 ms, several times per request, is felt by /health).
    sys.setswitchinterval(SWITCH_INTERVAL)
    srv.start()
    try:
        yield
    finally:
        await run_in_threadpool(srv.stop)
        log.info("stopped")


def create_app(*, model: str | None = None, parallel: int = SERVE["parallel"], api_keys: list[str] | None = None,
               max_slowdown_ppm: int = DEFAULT_SLOWDOWN_PPM, memory_budget: int | None = None,
               state_dir: str | Path = SERVE["state_dir"], max_body: int = SERVE["max_body"], n_ctx: int | None = None,
               on_load_error=None, body_timeout: float = BODY_TIMEOUT, device: str = "cpu",
               weights: str = SERVE["weights"], compile: bool = SERVE["compile"],
               n_predict: int = SERVE["n_predict"], max_queued_jobs: int = SERVE["max_queued_jobs"]) -> FastAPI:
    """The FastAPI app; the options are `remat serve`'s. `model`: a spec for `load_model` (None: the embedded
    default), decoding on `device` (resolved: `cpu`, `cuda:0`), where jobs train unless they say. The model loads
    in a background thread when the app starts (lifespan): /health answers 503 until it is ready.
    `on_load_error(message)` is called if loading fails."""
    app = openapi.App(title="remat", version=VERSION, lifespan=lifespan,
                      default_response_class=errors.SafeJSONResponse,
                      description="Serve a model and fine-tune it: llama.cpp's and OpenAI's API shapes.")
    app.state.bodies = _bodies(model, n_ctx, parallel)
    app.state.server = Server(model=model, parallel=parallel, max_slowdown_ppm=max_slowdown_ppm,
                              memory_budget=memory_budget, state_dir=Path(state_dir), n_ctx=n_ctx,
                              on_load_error=on_load_error, device=device, weights=weights,
                              compile=compile, n_predict=n_predict, max_queued_jobs=max_queued_jobs)
    app.add_middleware(BodyLimitMiddleware, limit=max_body, timeout=body_timeout)
    app.add_middleware(ApiKeyMiddleware, keys=list(api_keys or []))
    app.add_middleware(HeadMiddleware)  # added last: runs first (a HEAD is the GET, checked alike)
    page.install(app)  # the web page at /, served without a key (its middleware runs before the key check)
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    openapi.install(app, keys=bool(api_keys))
    return app


def _bodies(model: str | None, n_ctx: int | None, parallel: int) -> dict:
    """The request models as the served model bounds them (`params.bounded`), from its config (no weights);
    the unbounded ones when the config cannot be read (the load reports why, in the background)."""
    from remat.models.load import load_config, max_ctx

    try:
        config = load_config(model)
    except Exception:  # noqa: BLE001 - a bad model fails to load, and /health says why
        return {}
    limits = params.Limits(n_ctx=n_ctx or max_ctx(config), vocab=int(config.vocab_size), parallel=parallel)
    return params.bounded(limits)


# ---------------------------------------------------------------------------------------------------------
# command line


def main(args: ServeSettings) -> int:
    """Run the server until interrupted. 0 on a clean stop, 2 for a bad model or setting, 1 if loading fails."""
    import uvicorn

    from remat.models.load import ModelError, load_config

    try:
        config = load_config(args.model)  # a bad spec fails now, not in the background
    except ModelError as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    max_ctx = getattr(config, "max_position_embeddings", None)
    if args.ctx is not None and max_ctx is not None and args.ctx > max_ctx:
        print(f"remat: error: --ctx {args.ctx} is above the model's maximum context {max_ctx}", file=sys.stderr)
        return 2
    import torch

    from remat.base.settings import UsageError
    from remat.core import devices

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = devices.resolve(args.device)  # a device this machine lacks: refused now, one line
    except UsageError as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    devices.prepare(device)
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
                     state_dir=args.state_dir, max_body=args.max_body, n_ctx=args.ctx, on_load_error=on_load_error,
                     body_timeout=args.body_timeout, device=str(device), weights=args.weights,
                     compile=args.compile, n_predict=args.n_predict, max_queued_jobs=args.max_queued_jobs)
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
