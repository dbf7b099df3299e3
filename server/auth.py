"""Who may talk to the server: API key (Bearer or x-api-key, constant-time), Host check, body size.

An ASGI middleware (no per-request Starlette objects). `/health` is public. With a key, the key is
the check, except for `page_paths` (the chat page's static files, which carry no data: a browser
opening the URL cannot send a key); without one (loopback only), the Host header must be a local name
on every path but `/health` (DNS-rebinding guard).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

from server.openai_api import error_body

PUBLIC_PATHS = frozenset({"/health"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name part of a Host header ("[::1]:8080" -> "::1", "Example.COM:80" -> "example.com")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(name: str, bind_host: str, allowed: list[str]) -> bool:
    if not name:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name == bind_host.lower() or name in {a.lower() for a in allowed}


class Guard:
    def __init__(self, app: Any, api_key: str | None, bind_host: str, allowed_hosts: list[str], max_body: int,
                 page_paths: frozenset[str] = frozenset()):
        self.app = app
        self.page_paths = page_paths
        self.key = api_key.encode() if api_key else None
        self.bind_host = bind_host
        self.allowed = list(allowed_hosts)
        self.max_body = max_body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.key is not None and scope["path"] not in self.page_paths:
            given = headers.get("x-api-key")
            auth = headers.get("authorization", "")
            if given is None and auth[:7].lower() == "bearer ":
                given = auth[7:].strip()
            if not given:
                await _reject(send, 401, "no API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                              "missing_api_key")
                return
            if not hmac.compare_digest(given.encode(), self.key):
                await _reject(send, 401, "invalid API key", "invalid_api_key")
                return
        elif self.key is None:
            name = host_name(headers.get("host", ""))
            if not host_allowed(name, self.bind_host, self.allowed):
                await _reject(send, 403, f"Host '{name}' is not allowed (add it to the config's allowed_hosts, or "
                              "use an API key)", "host_not_allowed")
                return
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                await _reject(send, 400, "bad Content-Length", "bad_request")
                return
            if too_big:
                await _reject(send, 413, f"the request body is {length} bytes; the limit is {self.max_body} "
                              "(max_body_bytes)", "body_too_large")
                return
        await self.app(scope, receive, send)


async def _reject(send: Any, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
