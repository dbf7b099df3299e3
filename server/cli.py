"""`python -m server --config FILE [--host H] [--port P] [--api-key K] [--log FILE]`: the headless server.

`main(argv)` is also what `strata-desk serve` calls. It validates the config (a bad value stops the
start with a message naming the key), refuses to listen beyond loopback without an API key, and
runs uvicorn with the app from server/app.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from server.auth import is_loopback
from server.config import ConfigError, load_config
from server.engine_client import say
from server.urls import api_url, server_url


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server", description="strata-desk HTTP server (OpenAI API)")
    p.add_argument("--config", required=True, help="run config strata-<model>.json")
    p.add_argument("--host", help="address to bind (default: the config's, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: the config's, 8080)")
    p.add_argument("--api-key", help="API key (else the config's, else env STRATA_API_KEY)")
    p.add_argument("--log", help="engine log file (default: the config's 'log', else the user log dir)")
    return p.parse_args(argv)


def cannot_listen(host: str, port: int) -> str | None:
    """Why host:port cannot be bound (a busy port, an address not on this machine), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
        updates = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        if updates:
            config = config.model_copy(update=updates)
            type(config).model_validate(config.model_dump())
    except (ConfigError, ValueError) as exc:
        print(f"strata-desk: {exc}", file=sys.stderr)
        return 2
    key = args.api_key if args.api_key is not None else config.api_key
    if key is None:
        key = os.environ.get("STRATA_API_KEY")
    if key is not None and not key.strip():
        print("strata-desk: the API key is empty; give a real key or none", file=sys.stderr)
        return 2
    if not is_loopback(config.host) and not key:
        print(f"strata-desk: refusing to listen on {config.host} (beyond this machine) without an API key: set "
              "'api_key' in the config, --api-key, or STRATA_API_KEY", file=sys.stderr)
        return 2
    problem = cannot_listen(config.host, config.port)
    if problem:
        print(f"strata-desk: cannot listen on {config.host}:{config.port}: {problem} (another server on that port? "
              "`strata-desk ps` lists the ones started here; or choose another with --port)", file=sys.stderr)
        return 2
    import uvicorn

    from server.app import build_app

    app = build_app(config, str(Path(args.config).resolve()), key, Path(args.log) if args.log else None)
    say(f"serving {config.served_name} on {api_url(server_url(config.host, config.port))} (the engine is loading)")
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           access_log=False, lifespan="on", timeout_graceful_shutdown=5))
    server.run()
    return 0
