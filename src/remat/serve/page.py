"""The web page of `remat serve`: `GET /` and its static files under `/ui/`, shipped in the package.

The page (static/index.html, app.js, style.css: hand-written, nothing loaded from elsewhere) talks to the
server through its public API only: chat, training jobs with their event streams, and adapter scales.

`install(app)` adds the routes and makes them public: with `--api-key` the page itself loads without a key
(it holds no data; as llama.cpp's server does for its page) and asks for the key, which it sends with
every API call.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response

__all__ = ["install", "router"]

STATIC = Path(__file__).with_name("static")
PREFIX = "/ui/"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
# The page loads nothing from outside the server, and runs no inline script.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP,
           "Referrer-Policy": "no-referrer"}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> Response:
    path = STATIC / name
    # Only plain files that sit in static/ itself: no "..", no folders, no links out.
    if "/" in name or "\\" in name or name.startswith(".") or path.suffix not in TYPES or not path.is_file():
        return JSONResponse({"error": {"code": 404, "message": f"no file {PREFIX}{name}",
                                       "type": "not_found_error"}}, status_code=404)
    return FileResponse(path, media_type=TYPES[path.suffix], headers=HEADERS)


@router.get("/")
async def index() -> Response:
    return _file("index.html")


@router.get(PREFIX + "{name}")
async def static_file(name: str) -> Response:
    return _file(name)


class PublicPage:
    """Serves the page's GET and HEAD requests before any key check; everything else passes on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD"):
            path = scope["path"]
            if path == "/":
                return await _file("index.html")(scope, receive, send)
            if path.startswith(PREFIX):
                return await _file(path[len(PREFIX):])(scope, receive, send)
        return await self.app(scope, receive, send)


def install(app: FastAPI) -> None:
    """Add the page to the app: its routes, served without a key (added last, so it runs first)."""
    app.include_router(router)
    app.add_middleware(PublicPage)
