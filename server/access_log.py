"""One line per HTTP request in the server log, as llama-server writes them: status, method, path,
client, time, and for a completion its tokens. Refused requests (401, 404, 413, 503 ...) leave a
line too. Successful polls (`/metrics`, `/v1/status`; the dashboard reads one a second) are left
out, and so is `/health`, whose 503 only says "loading" (the server narrates its start itself).

An ASGI middleware around the whole app (the `Guard` included). A route puts what it wants said
about its request in the ASGI scope's state (`request.state.summary`, a callable returning text).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

QUIET_PATHS = frozenset({"/health", "/metrics", "/metrics/prometheus", "/v1/status"})


def request_line(status: int, method: str, path: str, client: str, seconds: float, summary: str = "") -> str:
    took = f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"
    return f"{status} {method} {path} from {client} in {took}" + (f": {summary}" if summary else "")


class AccessLog:
    def __init__(self, app: Any, say: Callable[[str], None]) -> None:
        self.app = app
        self.say = say

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500  # what the client gets when the app raises before answering
        state = scope.setdefault("state", {})

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            if path not in QUIET_PATHS or (status >= 400 and path != "/health"):
                client = scope.get("client") or ("-", 0)
                summary = state.get("summary")
                self.say(request_line(status, scope.get("method", "-"), path, str(client[0]),
                                      time.monotonic() - started, summary() if summary else ""))
