"""A server's address in one place: host and port to URL, URL back to host and port, what a user
typed to a base URL. Pure strings (the CLI, the launcher, the bench and the dashboard use it)."""

from __future__ import annotations


def connect_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def server_url(host: str, port: int) -> str:
    """The base URL a client uses for a server listening on host:port (IPv6 in brackets)."""
    host = connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def api_url(base_url: str) -> str:
    """The URL to give OpenAI clients."""
    return base_url.rstrip("/") + "/v1"


def base_url(typed: str) -> str:
    """What a user typed ("host:8080", "http://localhost:8080/v1/") as a base URL."""
    url = typed.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if "://" not in url:
        url = "http://" + url
    return url.replace("://localhost:", "://127.0.0.1:")


def host_port(url: str) -> tuple[str, int | None]:
    """("::1", 8080) from "http://[::1]:8080/v1"; the port is None when the URL names none."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit() or (host.startswith("[") != host.endswith("]")):
        return rest.strip("[]"), None
    return host.strip("[]"), int(port)
