"""The OpenAPI document, true to the server: validation errors are 400 with the error model (FastAPI's
default 422 `HTTPValidationError` is never sent), and the middleware's answers (401, 408, 413) are listed."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from remat.serve.errors import DESCRIPTIONS
from remat.serve.middleware import PUBLIC_PATHS

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# Request bodies read by `remat.serve.body` (in a worker thread, not by FastAPI): their schemas are added here.
BODY_MODELS: set[type[BaseModel]] = set()


def _error(status: int) -> dict:
    return {"description": DESCRIPTIONS[status], "content": {"application/json": {"schema": _ERROR_REF}}}


def _fix_operation(path: str, method: str, op: dict, keys: bool) -> None:
    answers = op.setdefault("responses", {})
    default_422 = answers.get("422", {}).get("content", {}).get("application/json", {}).get("schema", {})
    if "HTTPValidationError" in default_422.get("$ref", ""):
        del answers["422"]
        answers.setdefault("400", _error(400))
    if "requestBody" in op:
        answers.setdefault("400", _error(400))  # malformed JSON, a bad Content-Length
        answers.setdefault("408", _error(408))
        answers.setdefault("413", _error(413))
    if keys and path not in PUBLIC_PATHS:
        answers.setdefault("401", _error(401))


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_INT64_MAX = 2**63 - 1


def _exact_bounds(node: object) -> None:
    """FastAPI's OpenAPI models hold bounds as floats: 2**63 - 1 becomes 2**63. Make integral bounds
    integers again (the int64 bounds of seeds and event ids exactly)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = min(int(value), _INT64_MAX) if value > 0 else max(int(value), -_INT64_MAX - 1)
            else:
                _exact_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_bounds(value)


def _add_body_models(doc: dict[str, Any], bodies: dict) -> None:
    """The schemas of the bodies FastAPI does not read itself (every body: `remat.serve.body`), as it would
    write them (validation mode), each as the app narrows it (`bodies`: the served model's bounds)."""
    if not BODY_MODELS:
        return
    models = sorted((bodies.get(m, m) for m in BODY_MODELS), key=lambda m: m.__name__)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)


def document(app: FastAPI, keys: bool) -> dict:
    """The app's OpenAPI document, made once."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                _fix_operation(path, method, op, keys)
        _add_body_models(doc, getattr(app.state, "bodies", None) or {})
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        _exact_bounds(doc)
        app.openapi_schema = doc
    return app.openapi_schema


class App(FastAPI):
    """FastAPI whose OpenAPI document is `document`'s (`keys`: the server asks for API keys: 401 is listed)."""

    keys = False

    def openapi(self) -> dict[str, Any]:
        return document(self, self.keys)


def install(app: App, keys: bool) -> None:
    app.keys = keys
