"""The chat page at `/`: static HTML, CSS and JS shipped in `server/static/`, no build step, no CDN.

The files carry no data, so they are served without the API key (a browser cannot send one when it
opens a URL); the page sends the key the user types with every API call, and those calls meet the
key rule as any client's do. Without a key the Host check still covers the page (server/auth.py).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import Route

STATIC = Path(__file__).resolve().parent / "static"
FILES = {"/": "index.html", "/static/chat.css": "chat.css", "/static/chat.js": "chat.js"}
PAGE_PATHS = frozenset(FILES)  # what server/auth.py's Guard lets through without the key
HEADERS = {
    "Cache-Control": "no-cache",  # a new version of the server is picked up at once
    "X-Content-Type-Options": "nosniff",
    # only this server's own files and API: no inline script, no other origin, no framing
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
}


async def _serve(request: Request) -> FileResponse:
    return FileResponse(STATIC / FILES[request.url.path], headers=HEADERS)


def routes() -> list[Route]:
    """One GET route per file of the page."""
    return [Route(path, _serve, methods=["GET"]) for path in FILES]


__all__ = ["PAGE_PATHS", "routes"]
