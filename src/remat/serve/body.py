"""Large request bodies (training data) parsed and validated in a worker thread, without stalling the server.

A worker thread alone is not enough: `json.loads` and pydantic hold the GIL for one C call over the whole
body, and the garbage collector's full passes over its millions of new objects hold it too (a 57 MiB body
kept `/health` waiting ~600 ms). So the JSON is read in pieces (the top object and its arrays member by
member, each value by the C scanner), and the collector pauses while a body is parsed and validated (its
objects hold no reference cycles: reference counting frees them).

The errors are FastAPI's own (`RequestValidationError`, rendered by `errors.on_validation`), so a body
refused here reads exactly as one FastAPI refused.
"""

from __future__ import annotations

import codecs
import gc
import json
import json.scanner
import re
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from remat.serve.errors import ApiError

__all__ = ["Parsed", "answer", "gc_paused", "loads", "openapi_body", "read", "validate"]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

_WS = re.compile(r"[ \t\n\r]*")
# One JSON value at an index, in C: (value, end), or StopIteration(index) when none starts there. (typeshed
# types make_scanner's argument as make_scanner itself; it takes the decoder whose settings it reads.)
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
PIECE = 1 << 20  # bytes decoded per call
DEPTH = 2  # the top object and the arrays in it are walked here; deeper values are one C call each

class _GcPause:
    """No cyclic garbage collection while any thread is inside (the first in turns it off, the last out
    restores it)."""

    def __init__(self) -> None:
        self.lock, self.holders, self.was_enabled = threading.Lock(), 0, False

    def __enter__(self) -> None:
        with self.lock:
            if self.holders == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.holders += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0 and self.was_enabled:
                gc.enable()


gc_paused = _GcPause()


def _decode(chunks: list[bytes]) -> str:
    """The text of a JSON body (UTF-8, -16 or -32, as `json.loads` reads bytes), decoded piece by piece."""
    start = b"".join(chunks[:4])[:4]  # what json.detect_encoding reads
    decoder = codecs.getincrementaldecoder(json.detect_encoding(start))("surrogatepass")
    parts = [decoder.decode(chunk[i:i + PIECE]) for chunk in chunks for i in range(0, len(chunk), PIECE)]
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def _skip(text: str, i: int) -> int:
    """The index of the first non-whitespace character from `i`."""
    m = _WS.match(text, i)
    return m.end() if m else i


def _value(text: str, i: int, depth: int) -> tuple[Any, int]:
    c = text[i:i + 1]
    if depth and c == "{":
        return _object(text, i, depth)
    if depth and c == "[":
        return _array(text, i, depth)
    try:
        return _scan(text, i)
    except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", text, e.value) from None


def _next(text: str, i: int, close: str) -> tuple[bool, int]:
    """After a member: (True, index after `close`) at the end, (False, index of the next member) after ','."""
    i = _skip(text, i)
    c = text[i:i + 1]
    if c == close:
        return True, i + 1
    if c != ",":
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
    return False, _skip(text, i + 1)


def _object(text: str, i: int, depth: int) -> tuple[dict, int]:
    out: dict = {}
    i = _skip(text, i + 1)
    if text[i:i + 1] == "}":
        return out, i + 1
    while True:
        if text[i:i + 1] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = _scan(text, i)
        i = _skip(text, i)
        if text[i:i + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        out[key], i = _value(text, _skip(text, i + 1), depth - 1)
        done, i = _next(text, i, "}")
        if done:
            return out, i


def _array(text: str, i: int, depth: int) -> tuple[list, int]:
    out: list = []
    i = _skip(text, i + 1)
    if text[i:i + 1] == "]":
        return out, i + 1
    while True:
        value, i = _value(text, i, depth - 1)
        out.append(value)
        done, i = _next(text, i, "]")
        if done:
            return out, i


def loads(raw: bytes | str | list[bytes]) -> Any:
    """`json.loads(raw)`, with no single C call over the whole text; `raw` may come in pieces."""
    text = raw if isinstance(raw, str) else _decode([raw] if isinstance(raw, bytes) else raw)
    value, i = _value(text, _skip(text, 0), DEPTH)
    i = _skip(text, i)
    if i != len(text):
        raise json.JSONDecodeError("Extra data", text, i)
    return value


def _errors(e: ValidationError) -> list[dict[str, Any]]:
    """FastAPI's error list for a body, without the inputs (they are parts of the body: see `validate`)."""
    return [{**{k: v for k, v in err.items() if k != "input"}, "loc": ("body", *err["loc"])} for err in e.errors()]


def validate(model: type[M], raw: bytes | list[bytes]) -> M:
    """`raw` parsed and validated as `model`, or FastAPI's RequestValidationError (a 400 naming the field).
    A refused body's objects are freed here, not in the thread that handles the error (the event loop)."""
    if not any(raw) if isinstance(raw, list) else not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    errors: list[dict[str, Any]] = []
    with gc_paused:
        try:
            data = loads(raw)
        except json.JSONDecodeError as e:  # as FastAPI words it
            errors = [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {},
                       "ctx": {"error": e.msg}}]
        except UnicodeDecodeError as e:
            errors = [{"type": "json_invalid", "loc": ("body", e.start), "msg": "JSON decode error", "input": {},
                       "ctx": {"error": f"not {e.encoding} text"}}]
        else:
            try:
                return model.model_validate(data)
            except ValidationError as e:
                errors = _errors(e)
            del data
    raise RequestValidationError(errors)


class Parsed(Generic[M]):
    """A parsed body, handed over once (`take`): whoever takes it holds the last reference, so the thread
    that uses it frees it (a request's dependencies are otherwise freed on the event loop)."""

    def __init__(self, value: M):
        self._value: M | None = value

    def take(self) -> M:
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("the body was already taken")
        return value


async def read(request: Request, model: type[M]) -> Parsed[M]:
    """The request's body as `model`, parsed and validated in a worker thread. The pieces are handed over
    as they came: even joining tens of MiB into one `bytes` on the event loop is felt (~100 ms)."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    return Parsed(await run_in_threadpool(validate, model, chunks))


def _answer(fn: Callable[[M], R], parsed: Parsed[M]) -> R:
    value = parsed.take()
    error: ApiError | None = None
    with gc_paused:
        try:
            answer = fn(value)
        except ApiError as e:  # raised anew below: its traceback's frames hold the body, freed here
            error = ApiError(e.status, e.message, code=e.code, type=e.type, extra=e.extra)
        del value
    if error is not None:
        raise error
    return answer


async def answer(fn: Callable[[M], R], parsed: Parsed[M]) -> R:
    """`fn(body)` in a worker thread, with the collector paused; the body is freed in that thread, whether
    `fn` answers or raises ApiError."""
    return await run_in_threadpool(_answer, fn, parsed)


def openapi_body(model: type[BaseModel], description: str | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body with `read`: the body is `model` (added to the
    document's components by `remat.serve.openapi`)."""
    from remat.serve import openapi

    openapi.BODY_MODELS.add(model)
    body: dict[str, Any] = {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{model.__name__}"}}}}
    if description:
        body["description"] = description
    return {"requestBody": body}
