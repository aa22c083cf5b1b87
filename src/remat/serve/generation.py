"""What the generation routes share: sampling settings from a request, decoding in a worker thread that
stops when the client leaves (streaming or not), server-sent events, and the OpenAPI text of a stream."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from remat.base.settings import one_line
from remat.serve.engine import Generation, SamplingParams
from remat.serve.errors import ApiError, error_body

log = logging.getLogger("remat.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# One server-sent event (OpenAPI before 3.2: the schema of a text/event-stream describes each event).
SSE_EVENT = {"type": "object", "properties": {
    "data": {"type": "string", "description": "a JSON object (the chunk), or [DONE] at the end of an OpenAI stream"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def streams(model: type, what: str) -> dict:
    """OpenAPI `responses[200]` of a route that answers JSON, or server-sent events with `stream: true`."""
    return {200: {"model": model, "description": f"{what}; with `stream: true`, server-sent events",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def sse(data: dict | str, event: str | None = None, id: int | None = None) -> str:
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append("data: " + (data if isinstance(data, str) else json.dumps(data)))
    return "\n".join(lines) + "\n\n"


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def sampling(body, n_predict: int | None, stop: str | list[str] | None) -> SamplingParams:
    seed = getattr(body, "seed", None)
    return SamplingParams(
        n_predict=-1 if n_predict is None else n_predict,
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        seed=-1 if seed is None else seed, stop=[] if stop is None else [stop] if isinstance(stop, str) else list(stop),
        lora=[x.model_dump() for x in body.lora] if body.lora is not None else None,
    )


def finish_reason(g: Generation) -> str:
    return "length" if g.stop_type == "limit" else "stop"


def usage(g: Generation) -> dict:
    return {"prompt_tokens": g.n_prompt, "completion_tokens": g.n_predicted,
            "total_tokens": g.n_prompt + g.n_predicted}


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_whole(g: Generation, request: Request) -> None:
    """Decode to the end in a worker thread; a client that hangs up stops it at the next token."""
    work = asyncio.ensure_future(run_in_threadpool(g.run))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            g.cancel.set()
    await work


async def pieces(g: Generation):
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


def stream_error(e: BaseException) -> dict:
    if isinstance(e, ApiError):
        return e.body()
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return error_body(500, f"generation failed: {type(e).__name__}: {one_line(e)}", "server_error")
