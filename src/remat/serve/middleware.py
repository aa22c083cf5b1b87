"""Pure ASGI middleware: they run before FastAPI reads anything (API keys, body size and read timeout)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json

from remat.base.settings import ServeSettings
from remat.serve.errors import error_body

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/v1/models", "/models"})
BIG_BODY_PATHS = ("/train", "/lora-adapters")  # the routes whose bodies may be large (training data)
SMALL_BODY = 16 << 20  # every other route: prompts, whose length the served context bounds far below this
BODY_TIMEOUT: float = ServeSettings.model_fields["body_timeout"].default  # seconds a body may pause (--body-timeout)


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
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
            return await send_json(send, 401, error_body(401, msg, "authentication_error"),
                                   [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole body first: 413 over the limit (by Content-Length and by the bytes that arrive), 408
    when it stops arriving for `timeout` seconds. Bodies are JSON whatever the client called them."""

    def __init__(self, app, limit: int, timeout: float = BODY_TIMEOUT):
        self.app, self.limit, self.timeout = app, limit, timeout

    def limit_for(self, path: str) -> int:
        return self.limit if path.startswith(BIG_BODY_PATHS) else min(self.limit, SMALL_BODY)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        limit = self.limit_for(scope["path"])
        too_big = error_body(413, f"the request body is larger than the limit of {limit} bytes for "
                                  f"{scope['path']} (--max-body)")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                return await send_json(send, 400, error_body(400, "Content-Length is not a number"))
            if int(length) > limit:
                return await send_json(send, 413, too_big, [(b"connection", b"close")])
        chunks = await self._read(receive, send, limit, too_big)
        if chunks is None:
            return
        if any(chunks) and not headers.get(b"content-type", b"").split(b";")[0].strip().endswith(b"json"):
            # Every body here is JSON: read it as JSON whatever the client called it (curl -d says a form).
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        pieces = collections.deque(chunks or [b""])  # as they came: joining tens of MiB here would hold the loop

        async def replay():
            if pieces:
                chunk = pieces.popleft()
                return {"type": "http.request", "body": chunk, "more_body": bool(pieces)}
            return await receive()  # after the body: disconnect notices, for streaming responses

        return await self.app(scope, replay, send)

    async def _read(self, receive, send, limit: int, too_big: dict) -> list[bytes] | None:
        """The body's pieces, or None once an error was sent (or the client left)."""
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                await send_json(send, 408, error_body(408, f"the request body stopped arriving for {self.timeout:g} "
                                                           "seconds"), [(b"connection", b"close")])
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_json(send, 413, too_big, [(b"connection", b"close")])
                return None
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks


class _Answered(Exception):
    """A HEAD's answer is complete: stop the GET that made it (a stream would go on)."""


class HeadMiddleware:
    """HEAD answers wherever GET does (RFC 9110): the GET's status and headers, no body. A stream (a job's
    events) is stopped once its headers are out."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message) -> None:
            if message["type"] == "http.response.start":
                return await send(message)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise _Answered

        with contextlib.suppress(_Answered):
            await self.app({**scope, "method": "GET"}, receive, headers_only)
