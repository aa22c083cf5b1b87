"""What the generation routes share: decoding settings from a request (`decoding`), running a generation and
reading its events on the event loop (`events`, `whole`; a client that hangs up stops it), server-sent events,
and the OpenAPI text of a stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from remat.base.settings import one_line
from remat.serve.decoding import Event, Generation, Params
from remat.serve.engine import Engine
from remat.serve.errors import ApiError, error_body, invalid
from remat.serve.params import Sampled
from remat.serve.sampling import SAMPLERS, Sampling, sampler_names

log = logging.getLogger("remat.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# One server-sent event (OpenAPI before 3.2: the schema of a text/event-stream describes each event).
SSE_EVENT = {"type": "object", "properties": {
    "data": {"type": "string", "description": "a JSON object (the chunk), or [DONE] at the end of an OpenAI stream"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def streams(model: Any, what: str) -> dict:
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


# ---------------------------------------------------------------------------------------------------------
# settings


_SAMPLING = [f.name for f in dataclasses.fields(Sampling)
             if f.name not in ("logit_bias", "samplers", "logprobs", "post_sampling_probs", "typical_p")]


def decoding(e: Engine, body: Sampled, logprobs: int | None) -> Params:
    """The decoding settings of a request (llama.cpp's defaults for what it leaves out). `logprobs`: how many
    top log-probabilities to report with each token (None: none). Token ids and texts in `logit_bias` and
    `stop` are checked against the served model here."""
    given = {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    typical = body.typical_p if body.typical_p is not None else body.typ_p
    if typical is not None:
        given["typical_p"] = typical
    bias = _logit_bias(e, body)
    if body.ignore_eos:  # llama.cpp bans the end-of-generation tokens
        bias += [(t, -math.inf) for t in sorted(e.eos_ids)]
    sampling = dataclasses.replace(
        Sampling(), **given, logit_bias=tuple(bias), logprobs=logprobs,
        post_sampling_probs=bool(body.post_sampling_probs),
        samplers=SAMPLERS if body.samplers is None else sampler_names(body.samplers))
    stop = [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else body.stop
    stop_ids = [s for s in stop if isinstance(s, int)]
    e.check_tokens(stop_ids)
    return Params(sampling=sampling, n_predict=n_predict(body.max_new, e.n_predict),
                  stop=tuple(s for s in stop if isinstance(s, str)), stop_ids=frozenset(stop_ids),
                  seed=-1 if body.seed is None else body.seed, ignore_eos=bool(body.ignore_eos),
                  t_max_predict_ms=body.t_max_predict_ms or 0,
                  lora=None if body.lora is None else tuple((x.id, x.scale) for x in body.lora))


def n_predict(asked: int | None, most: int) -> int:
    """The tokens a request generates at most: what it asks (-1: no limit), capped by the server's `--n-predict`
    (`most`; -1: none), as llama.cpp's server caps it."""
    n = -1 if asked is None else asked
    return most if most >= 0 and not 0 <= n <= most else n


def _logit_bias(e: Engine, body: Sampled) -> list[tuple[int, float]]:
    """llama.cpp's forms: [[token or text, bias or false], ...] or {token or text: bias or false}; a text
    biases each of its tokens."""
    if body.logit_bias is None:
        return []
    items = body.logit_bias.items() if isinstance(body.logit_bias, dict) else body.logit_bias
    out: list[tuple[int, float]] = []
    n = e.vocab_size()
    for key, bias in items:
        value = -math.inf if bias is False else float(bias)
        ids = [int(key)] if isinstance(key, int) or key.isdigit() else e.tokenize(key)
        bad = [t for t in ids if not 0 <= t < n]
        if bad:
            raise invalid("logit_bias", f"logit_bias: token id {bad[0]} is out of the vocabulary (0..{n - 1})")
        out += [(t, value) for t in ids]
    return out


# ---------------------------------------------------------------------------------------------------------
# running


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def events(g: Generation) -> AsyncGenerator[Event, None]:
    """Start `g` and yield its events up to `end` (or `error`). Closing the iterator (the client left)
    cancels it."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(ev: Event) -> None:  # the decode loop's thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, ev)
        except RuntimeError:  # the loop is gone: the server is shutting down
            g.cancel.set()

    g.start(sink)
    try:
        while True:
            ev = await queue.get()
            yield ev
            if ev.kind in ("end", "error"):
                return
    finally:
        g.cancel.set()


async def whole(g: Generation, request: Request) -> None:
    """Decode `g` to the end; a client that hangs up stops it at the next token. Raises what decoding raised."""
    gone = asyncio.ensure_future(_disconnected(request))
    stream = events(g)
    try:
        while True:
            nxt = asyncio.ensure_future(anext(stream))
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():  # the client left: the pending read ends before the stream is closed
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await nxt
                return
            ev = nxt.result()
            if ev.kind == "error":
                raise ev.error if isinstance(ev.error, ApiError) else RuntimeError(f"generation failed: {ev.error}")
            if ev.kind == "end":
                return
    finally:
        gone.cancel()
        g.cancel.set()
        await stream.aclose()


def stream_error(e: BaseException | None) -> dict:
    if isinstance(e, ApiError):
        return e.body()
    log.error("generation failed: %s: %s", type(e).__name__, e)
    why = f"{type(e).__name__}: {one_line(e)}" if e is not None else "unknown"
    return error_body(500, f"generation failed: {why}", "server_error")
