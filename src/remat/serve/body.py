"""Request bodies parsed, validated and freed in a worker thread, without stalling the server: every JSON
body is read here (`reader`, `read`), not by FastAPI on the event loop.

A worker thread alone is not enough: a C call holds the GIL for as long as it runs, and the event loop
waits for it (`/health` with it). Over a 57 MiB body `json.loads` holds it ~270 ms, pydantic ~70 ms when it
drops what it validated before a bad record, joining the text into one `str` ~25 ms, freeing the parsed
records or the validated models ~30-100 ms, and `model_dump` ~450 ms. So here every C call is over a bounded
part:

- the text is decoded a piece at a time into a window of about `WINDOW` characters; each JSON value is
  scanned by the C scanner within the window, and one that does not fit is read a window of members at
  a time (an object or array) or given a larger window (a long string);
- a list longer than its field allows is refused before pydantic looks at its items (it checks every item
  first); a long list of models (`data`, `messages`) is validated `SLICE` items at a time;
- the lists are freed and dumped `SLICE` items at a time (`release`, `dump`).

The collector pauses while a body is parsed, validated and used (its objects hold no reference cycles:
reference counting frees them, and a full pass over millions of new objects holds the GIL too).

The errors are FastAPI's own (`RequestValidationError`, rendered by `errors.on_validation`), so a body
refused here reads exactly as one FastAPI refused.
"""

from __future__ import annotations

import codecs
import functools
import json
import json.scanner
import math
import re
import sys
import types
import typing
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from starlette.concurrency import run_in_threadpool

from remat.base import collector
from remat.serve.errors import ApiError

__all__ = ["Parsed", "answer", "dump", "loads", "openapi_body", "read", "reader", "release",
           "validate"]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

_WS = re.compile(r"[ \t\n\r]*")
# One JSON value at an index, in C: (value, end), or StopIteration(index) when none starts there. (typeshed
# types make_scanner's argument as make_scanner itself; it takes the decoder whose settings it reads.)
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
WINDOW = 1 << 18  # characters one C scan may look at (~1 ms), unless one string is longer
SLICE = 512  # list items validated or freed per C call (~1 ms)
NEAR_END = 16  # a scan that fails or ends this close to the window's end may only have run out of text


# ---------------------------------------------------------------------------------------------------------
# parsing


def _pieces(raw: str | list[bytes]) -> Iterator[str]:
    """The text in pieces of about WINDOW characters: bytes decoded as `json.loads` reads them (UTF-8, -16
    or -32, by the first bytes)."""
    if isinstance(raw, str):
        yield from (raw[i:i + WINDOW] for i in range(0, len(raw), WINDOW))
        return
    start = b"".join(raw[:4])[:4]  # what json.detect_encoding reads
    decoder = codecs.getincrementaldecoder(json.detect_encoding(start))("surrogatepass")
    for chunk in raw:
        for i in range(0, len(chunk), WINDOW):
            yield decoder.decode(chunk[i:i + WINDOW])
    yield decoder.decode(b"", final=True)


class _Text:
    """The part of the text being parsed (`text`, from the text's index `base`), read on from the pieces."""

    def __init__(self, raw: str | list[bytes]):
        self.pieces, self.text, self.base, self.done = _pieces(raw), "", 0, False

    def more(self, at: int, want: int = WINDOW) -> bool:
        """Drop the text before index `at` and read at least `want` more characters; False at the end."""
        if self.done:
            return False
        parts, n = [self.text[at - self.base:]], 0
        while n < want:
            piece = next(self.pieces, None)
            if piece is None:
                self.done = True
                break
            parts.append(piece)
            n += len(piece)
        self.text, self.base = "".join(parts), at
        return True

    def char(self, at: int) -> str:
        """The character at index `at`, '' at the end of the text."""
        while at - self.base >= len(self.text) and self.more(at):
            pass
        return self.text[at - self.base:at - self.base + 1]

    def skip(self, at: int) -> int:
        """The index of the first non-whitespace character from `at`."""
        while True:
            m = _WS.match(self.text, at - self.base)
            at = self.base + (m.end() if m else at - self.base)
            if at - self.base < len(self.text) or not self.more(at):
                return at

    def error(self, msg: str, at: int) -> json.JSONDecodeError:
        """`json.loads`'s error at index `at` (its line and column count from `base`)."""
        e = json.JSONDecodeError(msg, self.text, at - self.base)
        e.pos = at
        return e


def _value(src: _Text, at: int) -> tuple[Any, int]:
    """The value at index `at` and the index after it: one C scan when it fits the window."""
    while True:
        i, failure = at - src.base, None
        try:
            value, end = _scan(src.text, i)
            if end < len(src.text) - NEAR_END or src.done:  # a number may go on past the window ("1e" | "5")
                return value, src.base + end
        except StopIteration as e:
            failure = ("Expecting value", e.value)
        except json.JSONDecodeError as e:
            failure = (e.msg, e.pos)
        if failure and (src.done or (failure[1] < len(src.text) - NEAR_END
                        and not failure[0].startswith("Unterminated string"))):
            raise src.error(failure[0], src.base + failure[1])  # not for want of text
        room = len(src.text) - i
        if room < WINDOW:
            src.more(at)  # the value may fit a window that starts with it
        elif src.text[i] == "{":
            return _object(src, at)
        elif src.text[i] == "[":
            return _array(src, at)
        else:
            src.more(at, room)  # a string longer than the window: twice the window


def _next(src: _Text, at: int, close: str) -> tuple[bool, int]:
    """After a member: (True, index after `close`) at the end, (False, index of the next member) after ','."""
    at = src.skip(at)
    c = src.char(at)
    if c == close:
        return True, at + 1
    if c != ",":
        raise src.error("Expecting ',' delimiter", at)
    return False, src.skip(at + 1)


def _run(src: _Text, at: int, span: int, close: str) -> tuple[Any, int] | None:
    """The members of an array or object from index `at` up to the last ',' within `span` characters, in
    one C scan, and the index of that ','; None when there is no ',' or it is not between members (the
    scan then fails: a cut inside a string or a nested value leaves it unclosed)."""
    i = at - src.base
    cut = src.text.rfind(",", i, i + span)
    if cut <= i:
        return None
    text = ("[" if close == "]" else "{") + src.text[i:cut] + close
    try:
        members, end = _scan(text, 0)
    except (StopIteration, json.JSONDecodeError):
        return None
    return (members, src.base + cut) if end == len(text) else None


def _members(src: _Text, at: int, close: str, out: Any, one: Callable[[int], int]) -> tuple[Any, int]:
    """An array's or object's members from index `at` into `out`: as many as a window holds per C scan
    (`_run`), else one at a time (`one`: the index after the member at an index)."""
    at, span = src.skip(at + 1), WINDOW
    if src.char(at) == close:
        return out, at + 1
    while True:
        run = _run(src, at, span, close)
        if run is not None:
            members, at = run
            out.extend(members) if close == "]" else out.update(members)
        else:
            if src.text.find(",", at - src.base, at - src.base + span) > at - src.base:
                span = max(64, span // 2)  # a ',' inside a member: try fewer at once
            at = one(at)
        done, at = _next(src, at, close)
        if done:
            return out, at


def _object(src: _Text, at: int) -> tuple[dict, int]:
    out: dict = {}

    def member(at: int) -> int:
        if src.char(at) != '"':
            raise src.error("Expecting property name enclosed in double quotes", at)
        key, at = _value(src, at)
        at = src.skip(at)
        if src.char(at) != ":":
            raise src.error("Expecting ':' delimiter", at)
        out[key], at = _value(src, src.skip(at + 1))
        return at

    return _members(src, at, "}", out, member)


def _array(src: _Text, at: int) -> tuple[list, int]:
    out: list = []

    def item(at: int) -> int:
        value, at = _value(src, at)
        out.append(value)
        return at

    return _members(src, at, "]", out, item)


def loads(raw: bytes | str | list[bytes]) -> Any:
    """`json.loads(raw)`, with no C call over more than about WINDOW characters (unless one string is
    longer); `raw` may come in pieces. The error's `pos` is the text's index, as json.loads gives it."""
    if isinstance(raw, str) and raw.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", raw, 0)
    src = _Text([raw] if isinstance(raw, bytes) else raw)
    value, at = _value(src, src.skip(0))
    at = src.skip(at)
    if src.char(at):
        raise src.error("Extra data", at)
    return value


# ---------------------------------------------------------------------------------------------------------
# freeing


def _counts(children: list) -> list[int]:
    return [sys.getrefcount(c) for c in children]


_ALONE = _counts([[]])[0]  # a list's references in `_counts` when the list of children is its only holder


def _children(x: object) -> list:
    """The lists `x` holds directly (a dict's values, a model's fields and extra fields) that hold more than
    SLICE items and that nothing else holds."""
    if isinstance(x, BaseModel):
        held = [*vars(x).values(), *(x.__pydantic_extra__ or {}).values()]
    elif isinstance(x, dict):
        held = list(x.values())
    else:
        return []
    return [c for c, refs in zip(held, _counts(held)) if type(c) is list and len(c) > SLICE and refs <= _ALONE + 1]


def _empty(items: list) -> None:
    while items:
        part = items[-SLICE:]
        del items[-SLICE:]
        for item, refs in zip(part, _counts(part)):
            if refs <= _ALONE:  # nothing but `part` holds it
                release(item)
        del part


def release(x: object) -> None:
    """Take `x` apart so that no C call frees much at once (60,000 records freed at once hold the GIL
    ~30-100 ms): `x` itself if it is a list, else the long lists it holds that nothing else holds, are
    emptied SLICE items at a time, depth first. An item something else holds is left as it is."""
    if type(x) is list:
        _empty(x)
    for child in _children(x):
        _empty(child)


def dump(x: BaseModel, **options: Any) -> dict[str, Any]:
    """`x.model_dump(**options)`, its long lists a slice at a time (one C call over 60,000 records holds
    the GIL ~450 ms)."""
    fields = vars(x)
    long = {k for k, v in fields.items() if isinstance(v, list) and len(v) > SLICE and _items(type(x), k)}
    out = x.model_dump(exclude=long, **options)
    for key in long:
        adapter, items = _items(type(x), key), fields[key]
        assert adapter is not None
        out[key] = [d for i in range(0, len(items), SLICE) for d in adapter.dump_python(items[i:i + SLICE], **options)]
    return out


# ---------------------------------------------------------------------------------------------------------
# validating


def _errors(e: ValidationError, prefix: tuple = ()) -> list[dict[str, Any]]:
    """FastAPI's error list for a body, without the inputs (they are parts of the body: see `validate`)."""
    return [{**{k: v for k, v in err.items() if k != "input"}, "loc": ("body", *prefix, *err["loc"])}
            for err in e.errors()]


def _lengths(annotation: Any, metadata: list) -> list[float]:
    """The most items a list-typed field may hold (inf: no bound), for each list its type may be (the list
    members of a union); [] when it is not a list."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *meta = typing.get_args(annotation)
        return _lengths(inner, metadata + [x for m in meta for x in (m.metadata if isinstance(m, FieldInfo) else [m])])
    if origin is list:
        return [min([m.max_length for m in metadata if getattr(m, "max_length", None) is not None], default=math.inf)]
    if origin in (typing.Union, types.UnionType):
        return [n for member in typing.get_args(annotation) for n in _lengths(member, [])]
    return []


@functools.cache
def _max_items(model: type[BaseModel], key: str) -> int | None:
    field = model.model_fields.get(key)
    most = max(_lengths(field.annotation, field.metadata), default=math.inf) if field is not None else math.inf
    return None if most == math.inf else int(most)


def _too_long(model: type[BaseModel], data: dict) -> list[dict[str, Any]]:
    """pydantic's errors for the list fields longer than they may be, before it validates their items (it
    validates every item first: two million token ids hold the GIL ~1 s)."""
    errors = []
    for key, value in data.items():
        limit = _max_items(model, key) if isinstance(value, list) else None
        if limit is not None and len(value) > limit:
            errors.append({"type": "too_long", "loc": ("body", key), "ctx": {"field_type": "List",
                           "max_length": limit, "actual_length": len(value)},
                           "msg": f"List should have at most {limit} items after validation, not {len(value)}"})
    return errors


def _has_model(annotation: Any) -> bool:
    return (isinstance(annotation, type) and issubclass(annotation, BaseModel)) or any(
        _has_model(a) for a in typing.get_args(annotation))


@functools.cache
def _items(model: type[BaseModel], key: str) -> TypeAdapter | None:
    """The validator of a list field of models, as the model checks it; None for a field of another type
    (a list of numbers or strings is checked in one call: its items are not checked again)."""
    field = model.model_fields.get(key)
    annotation = field.annotation if field is not None else None
    if annotation is None or typing.get_origin(annotation) is not list or not _has_model(annotation):
        return None
    config = model.model_config
    return TypeAdapter(annotation, config=ConfigDict(strict=bool(config.get("strict", False)),
                                                     allow_inf_nan=config.get("allow_inf_nan", True)))


def _validate_lists(model: type[BaseModel], data: dict) -> tuple[dict, list[dict[str, Any]]]:
    """`data` with each long list of models validated SLICE items at a time (pydantic drops what it
    validated before a bad item in one C call), and those items' errors. The model then checks the list
    itself and takes the items as they are."""
    out, errors = dict(data), []
    for key, value in data.items():
        adapter = _items(model, key) if isinstance(value, list) and len(value) > SLICE else None
        if adapter is None:
            continue
        items: list = []
        for start in range(0, len(value), SLICE):
            try:
                items += adapter.validate_python(value[start:start + SLICE])
            except ValidationError as e:
                errors += [{**err, "loc": ("body", key, err["loc"][1] + start, *err["loc"][2:])}
                           for err in _errors(e)]
        out[key] = items
    return out, errors


def _check(model: type[M], data: Any) -> M:
    """`data` validated as `model`, long lists a slice at a time; RequestValidationError when it is not."""
    too_long = _too_long(model, data) if isinstance(data, dict) else []
    if too_long:
        raise RequestValidationError(too_long)
    items, errors = _validate_lists(model, data) if isinstance(data, dict) else (data, [])
    checked: M | None = None
    try:
        checked = model.model_validate(items)
    except ValidationError as e:
        # With some items refused, the list's own check (at least one item) counted only the others.
        errors = [err for err in _errors(e) if not (errors and err["type"] == "too_short" and len(err["loc"]) == 2
                                                    and err["loc"][1] in data)] + errors
    finally:
        release(items)
    if not errors:
        assert checked is not None
        return checked
    release(checked)  # the items that passed: freed here, not with the error's traceback on the event loop
    checked = None
    raise RequestValidationError(errors)


def _json_error(e: ValueError | RecursionError) -> list[dict[str, Any]]:
    """FastAPI's error for a body that is not JSON (as it words a JSONDecodeError)."""
    if isinstance(e, json.JSONDecodeError):
        at, msg = e.pos, e.msg
    elif isinstance(e, UnicodeDecodeError):
        at, msg = e.start, f"not {e.encoding} text"
    else:  # an integer of over 4300 digits, arrays nested past the recursion limit
        at, msg = 0, str(e).split(";")[0]
    return [{"type": "json_invalid", "loc": ("body", at), "msg": "JSON decode error", "input": {},
             "ctx": {"error": msg}}]


def validate(model: type[M], raw: bytes | list[bytes]) -> M:
    """`raw` parsed and validated as `model`, or FastAPI's RequestValidationError (a 400 naming the field).
    A refused body's objects are freed here, not in the thread that handles the error (the event loop)."""
    if not any(raw) if isinstance(raw, list) else not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    with collector.paused:
        try:
            data = loads(raw)
        except (ValueError, RecursionError) as e:
            raise RequestValidationError(_json_error(e)) from None
        try:
            return _check(model, data)
        finally:
            release(data)
            del data


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
    """The request's body as `model` (as the app narrows it: `app.state.bodies`), parsed and validated in
    a worker thread. The pieces are handed over as they came: even joining tens of MiB into one `bytes` on
    the event loop is felt (~100 ms)."""
    bodies = getattr(request.app.state, "bodies", None) or {}
    checked: type[M] = bodies.get(model, model)
    chunks = [chunk async for chunk in request.stream() if chunk]
    return Parsed(await run_in_threadpool(validate, checked, chunks))


def reader(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency: the request's body as `model`, read by `read` (declare the body with `openapi_body`)."""

    async def body(request: Request) -> M:
        return (await read(request, model)).take()

    body.__name__ = f"read_{model.__name__}"
    return body


def _answer(fn: Callable[[M], R], parsed: Parsed[M]) -> R:
    box = [parsed.take()]  # the body's only reference, once `fn` returns, unless `fn` kept it
    error: ApiError | None = None
    with collector.paused:
        try:
            answer = fn(box[0])
        except ApiError as e:  # raised anew below: its traceback's frames hold the body, freed here
            error = ApiError(e.status, e.message, code=e.code, type=e.type, extra=e.extra)
        if _counts(box)[0] <= _ALONE:
            release(box[0])
        del box
    if error is not None:
        raise error
    return answer


async def answer(fn: Callable[[M], R], parsed: Parsed[M]) -> R:
    """`fn(body)` in a worker thread, with the collector paused; the body is freed in that thread, a slice
    at a time (`release`), whether `fn` answers or raises ApiError."""
    return await run_in_threadpool(_answer, fn, parsed)


def openapi_body(model: type[BaseModel], description: str | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body with `read`: the body is `model` (added to the
    document's components by `remat.serve.openapi`). Its list fields' validators are built now, not while
    a request waits (building one holds the GIL ~20 ms)."""
    from remat.serve import openapi

    openapi.BODY_MODELS.add(model)
    for key in model.model_fields:
        _items(model, key)
    body: dict[str, Any] = {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{model.__name__}"}}}}
    if description:
        body["description"] = description
    return {"requestBody": body}
