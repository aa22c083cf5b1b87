"""The server's one error type and how every error becomes `{"error": {"code", "message", "type", ...}}`.

`ApiError` is raised by the engine, the job manager and the routes; the exception handlers here turn it,
pydantic's validation errors, Starlette's HTTP errors and anything unexpected into that body, with
llama.cpp's / OpenAI's error types. Nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from remat.base.settings import one_line

__all__ = ["ApiError", "ErrorResponse", "SafeJSONResponse", "error_body", "error_response", "install",
           "responses"]

log = logging.getLogger("remat.serve")
M = TypeVar("M", bound=BaseModel)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "unavailable_error",
               501: "not_supported_error", 503: "unavailable_error"}


class ApiError(Exception):
    """A request the server refuses: `status` is the HTTP status, `code` names what is wrong (the status
    when not given), `type` is llama.cpp's error type, `extra` adds fields to the error object."""

    def __init__(self, status: int, message: str, *, code: int | str | None = None, type: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.code = status if code is None else code
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.extra = extra or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type, self.code, self.extra)


def invalid(param: str, message: str) -> ApiError:
    """400 naming the bad field (`param`), code `invalid_<param>`."""
    return ApiError(400, message, code=f"invalid_{param}", extra={"param": param})


# ---------------------------------------------------------------------------------------------------------
# the documented shape


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: int | str = Field(description="the HTTP status, or a name for what is wrong (e.g. insufficient_memory)")
    message: str = Field(description="one line for the user")
    type: str = Field(description="llama.cpp's error type: invalid_request_error, not_found_error, ...")


class ErrorResponse(BaseModel):
    error: ErrorDetail


DESCRIPTIONS = {400: "Invalid request (a field, the JSON, or a value the model cannot take)",
                401: "Missing or wrong API key", 404: "Not found", 405: "Method not allowed",
                408: "The request body did not arrive in time", 409: "Conflict with the job's state",
                413: "The request body is too large", 422: "The job does not fit the memory budget",
                429: "As many training jobs as the server queues are waiting",
                500: "The server failed", 503: "The model is loading, or the server is shutting down"}


def responses(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses, all with the error model."""
    return {s: {"model": ErrorResponse, "description": DESCRIPTIONS[s]} for s in statuses}


# ---------------------------------------------------------------------------------------------------------
# rendering


def _clean(x: object) -> object:
    """JSON-safe: non-finite floats become null, lone surrogates (from a client's "\\ud800") stay escaped."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, str):
        return x.encode("utf-8", "backslashreplace").decode("utf-8") if _has_surrogate(x) else x
    if isinstance(x, dict):
        return {_clean(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class SafeJSONResponse(JSONResponse):
    """JSON that never fails to render: NaN and infinities as null, lone surrogates escaped."""

    def render(self, content: object) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except (ValueError, UnicodeEncodeError):
            return json.dumps(_clean(content), ensure_ascii=False, separators=(",", ":")).encode()


def error_body(status: int, message: str, type: str | None = None, code: int | str | None = None,
               extra: dict | None = None) -> dict:
    err = {"code": status if code is None else code, "message": message,
           "type": type or ERROR_TYPES.get(status, "server_error")}
    for k, v in (extra or {}).items():
        err.setdefault(k, v)
    return {"error": _clean(err)}


def error_response(status: int, message: str, type: str | None = None, code: int | str | None = None,
                   extra: dict | None = None, headers: dict | None = None) -> JSONResponse:
    return SafeJSONResponse(error_body(status, message, type, code, extra), status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------------------
# validation messages


_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _where(loc: tuple) -> str:
    # Drop pydantic's union-member tags ("str", "list[constrained-int]", "TextRecord") from the location.
    parts = [str(p) for p in loc
             if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p[:1].isupper()
                                              or p.startswith(("constrained", "function-"))))]
    return ".".join(parts)


def _message(kind: str, where: str, err: Mapping[str, Any]) -> str:
    if not where:
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return "the request body must be a JSON object"
        if kind == "list_type":
            return "the request body must be a JSON array"
        return f"the request body: {err.get('msg', 'invalid value')}"
    if kind == "extra_forbidden":
        return f"unknown field '{where}'"
    if kind == "missing":
        return f"missing field '{where}'"
    return err.get("msg", "invalid value")


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    """One line naming each bad field, from pydantic's errors."""
    by_field: dict[str, list[str]] = {}
    for err in errors:
        kind, where = err.get("type", ""), _where(tuple(err.get("loc", ())))
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"malformed JSON in the request body: {ctx.get('error', 'cannot parse it')}"
        msg = _message(kind, where, err)
        if msg not in by_field.setdefault(where, []):
            by_field[where].append(msg)
    msgs = []
    for where, texts in list(by_field.items())[:5]:
        if texts[0].startswith(("unknown field", "missing field", "the request body")):
            msgs.append(texts[0])
        else:
            msgs.append(f"field '{where}': " + " or ".join(t[0].lower() + t[1:] for t in texts))
    more = f" (and {len(by_field) - 5} more)" if len(by_field) > 5 else ""
    return "; ".join(msgs) + more


def _param(errors: Sequence[Mapping[str, Any]]) -> str | None:
    wheres = [_where(tuple(e.get("loc", ()))) for e in errors]
    return wheres[0] or None if wheres else None


# ---------------------------------------------------------------------------------------------------------
# exception handlers


async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.code, exc.extra)


async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's locations start with where the value was: body, query, path, header
    errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in exc.errors()]
    param = _param(errors)
    return error_response(400, validation_message(errors), extra={"param": param} if param else None)


def _routes(routes):
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's wrapper of an included router
        if inner is not None:
            yield from _routes(inner.routes)
        else:
            yield route


def _allowed(request: Request) -> str:
    """Every method some route takes at this path (Starlette's own 405 names only the first route's). A path
    some route names exactly (`/train/plan`) lists only that route's methods, not those of a route with a
    parameter that would also match it (`/train/{job_id}`: no job is called `plan`)."""
    path = request.url.path
    matched = [r for r in _routes(request.app.router.routes)
               if getattr(r, "path_regex", None) is not None and r.path_regex.match(path)]
    exact = [r for r in matched if getattr(r, "path", None) == path]
    methods: set[str] = set()
    for route in exact or matched:
        methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 404 and msg == "Not Found":
        msg = f"no route {request.method} {request.url.path}"
    if exc.status_code == 405:
        headers["Allow"] = _allowed(request)
        msg = f"{request.method} is not allowed on {request.url.path} (allowed: {headers['Allow']})"
    return error_response(exc.status_code, msg, headers=headers or None)


async def on_any(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {one_line(exc)}", "server_error")


def install(app) -> None:
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_any)


def parse(model: type[M], data: object) -> M:
    """`model` validated from `data`, or ApiError 400 naming the first bad field (code `invalid_<field>`,
    or `unknown_field`), as a request body would be refused."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = list(e.errors())
        param = _param(errors)
        unknown = errors[0].get("type") == "extra_forbidden" and "." not in (param or "")
        code = "unknown_field" if unknown else f"invalid_{param.split('.')[0]}" if param else "invalid_request"
        raise ApiError(400, validation_message(errors), code=code,
                       extra={"param": param} if param else None) from None
