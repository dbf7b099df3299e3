"""Supervision of the server process (which starts the engine), for the dashboard and bench.

The server runs in its own session, so it outlives a dashboard that quits and leaves it running;
every server started here is recorded in the state file (`strata_desk.state`) so `attach` and the
next dashboard find it. `stop` sends SIGTERM (the server then ends its engine), waits, and kills
whatever is left of the process tree with SIGKILL.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from server.config import load_config
from server.urls import connect_host, host_port, server_url
from strata_desk import paths, state
from strata_desk.state import RunningServer, find_running, running_for

__all__ = ["LaunchError", "RunningServer", "ServerProcess", "busy_port_message", "find_running",
           "port_in_use", "running_for", "terminate_tree"]


class LaunchError(RuntimeError):
    """The server did not come up; `log_tail` holds the last lines of its log."""

    def __init__(self, message: str, log_tail: list[str] | None = None):
        self.log_tail = log_tail or []
        tail = "\n".join(self.log_tail)
        super().__init__(f"{message}\n--- server log (last lines) ---\n{tail}" if tail else message)


def server_args(config_path: Path | str, host: str | None = None, port: int | None = None,
                api_key: str | None = None) -> list[str]:
    """`python -m server`'s arguments; only what overrides the config is passed."""
    argv = ["--config", str(config_path)]
    if host:
        argv += ["--host", host]
    if port:
        argv += ["--port", str(port)]
    if api_key:
        argv += ["--api-key", api_key]
    return argv


def port_in_use(host: str, port: int) -> bool:
    """Something on this machine answers on host:port."""
    try:
        with socket.create_connection((connect_host(host), port), timeout=0.5):
            return True
    except OSError:
        return False


def busy_port_message(host: str, port: int) -> str:
    return (f"port {port} on {connect_host(host)} is already in use (a server already running? "
            "`strata-desk ps` lists the ones started here; or choose another with --port)")


ProgressCallback = Callable[[str], Any]


class ServerProcess:
    """One `python -m server --config FILE` process: start, wait until ready, stop, restart."""

    def __init__(
        self,
        config_path: Path,
        *,
        host: str | None = None,
        port: int | None = None,
        log_path: Path | None = None,
        api_key: str | None = None,
    ):
        self.config_path = Path(config_path).expanduser().resolve()
        self.host = host
        self.port = port
        self.api_key = api_key
        self.log_path = Path(log_path) if log_path else paths.log_path_for(self.config_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None  # set for a server adopted from the state file
        self._create_time: float | None = None

    @classmethod
    def adopt(cls, server: RunningServer) -> ServerProcess:
        """Take over a server found by `find_running()` (started by an earlier dashboard or bench)."""
        if not server.config:
            raise LaunchError(f"the server at {server.url} (pid {server.pid}) has no config on record")
        host, port = host_port(server.url)
        self = cls(Path(server.config), host=host, port=port,
                   log_path=Path(server.log) if server.log else None)
        self._pid = server.pid
        self._create_time = server.create_time
        return self

    # -- what it is ------------------------------------------------------------------------------

    def _listen(self) -> tuple[str, int]:
        config = load_config(self.config_path)
        return (self.host or config.host, self.port or config.port)

    @property
    def url(self) -> str:
        """The base URL (`http://127.0.0.1:8080`), from the overrides or the config."""
        return server_url(*self._listen())

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else self._pid

    @property
    def running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        if self._pid is not None:
            return RunningServer(self._pid, "", create_time=self._create_time).alive
        return False

    # -- start -----------------------------------------------------------------------------------

    def command(self) -> list[str]:
        return [sys.executable, "-m", "server", *server_args(self.config_path, self.host, self.port, self.api_key)]

    def start(self) -> None:
        """Spawn the server in its own session and record it; returns at once (see wait_ready)."""
        if self.running:
            return
        host, port = self._listen()  # raises ConfigError for a bad config, before anything starts
        if port_in_use(host, port):
            raise LaunchError(busy_port_message(host, port))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _rotate(self.log_path)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
        self._pid = None
        self._create_time = state.process_create_time(self._proc.pid)
        state.record(RunningServer(self._proc.pid, server_url(host, port), str(self.config_path),
                                   str(self.log_path), create_time=self._create_time))
        paths.remember_last_config(self.config_path)

    async def wait_ready(self, timeout: float, on_progress: ProgressCallback | None = None) -> None:
        """Poll /health until 200. Raises LaunchError (with the log tail) if the process exits or
        `timeout` seconds pass. `on_progress(text)` (sync or async) gets a line per poll."""
        url = self.url + "/health"
        start = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                elapsed = time.monotonic() - start
                if not self.running:
                    code = self._proc.returncode if self._proc else None
                    state.forget(self.pid or -1)
                    raise LaunchError(f"the server exited (code {code}) before it was ready", self.log_tail())
                try:
                    reply = await client.get(url)
                    if reply.status_code == 200:
                        await call_back(on_progress, f"ready after {elapsed:.1f} s")
                        return
                    body = _json(reply)
                    if body.get("status") == "error":  # the server gave up (bad model, engine died)
                        raise LaunchError(f"the server reports an error: {body.get('error') or body}",
                                          self.log_tail())
                    status = f"{body.get('status') or 'loading'} ({reply.status_code}), {elapsed:.0f} s"
                except httpx.HTTPError:
                    status = f"starting, {elapsed:.0f} s"
                await call_back(on_progress, status)
                if elapsed > timeout:
                    raise LaunchError(f"the server was not ready after {timeout:.0f} s", self.log_tail())
                await asyncio.sleep(0.2 if elapsed < 5 else 0.5)

    # -- stop ------------------------------------------------------------------------------------

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, wait up to `timeout` s, then SIGKILL the rest of the tree; drop the state record."""
        pid = self.pid
        if pid is None:
            return
        try:
            if self.running:
                terminate_tree(pid, timeout)
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            state.forget(pid)

    def restart(self) -> None:
        """Stop, then start again with the config as it is on disk now (call wait_ready after)."""
        self.stop()
        self._proc = None
        self._pid = None
        self.start()

    async def astop(self, timeout: float = 10) -> None:
        """`stop` in a worker thread, so an event loop (the dashboard's) keeps running meanwhile."""
        await asyncio.to_thread(self.stop, timeout)

    async def arestart(self) -> None:
        """`restart` in a worker thread (call wait_ready after)."""
        await asyncio.to_thread(self.restart)

    # -- log -------------------------------------------------------------------------------------

    def log_tail(self, n: int = 40) -> list[str]:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return [line.rstrip("\n") for line in deque(fh, maxlen=n)]
        except OSError:
            return []


def terminate_tree(pid: int, timeout: float = 10) -> None:
    """SIGTERM `pid`, wait up to `timeout` s for it and its descendants, SIGKILL what is left."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    with _suppress_gone():
        os.kill(pid, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(tree, timeout=timeout)
    for proc in alive:
        with _suppress_gone():
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


class _suppress_gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, (ProcessLookupError, psutil.NoSuchProcess))


LOG_ROTATE_BYTES = 16 << 20


def _rotate(log: Path) -> None:
    """Keep one previous log (`<name>.1`) once the log passes LOG_ROTATE_BYTES."""
    try:
        if log.stat().st_size > LOG_ROTATE_BYTES:
            os.replace(log, log.with_name(log.name + ".1"))
    except OSError:
        pass


def _json(reply: httpx.Response) -> dict[str, Any]:
    try:
        body = reply.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def call_back(callback: Callable[..., Any] | None, *args: Any) -> None:
    """Call a progress/result callback that may be a plain function or a coroutine function."""
    if callback is None:
        return
    result = callback(*args)
    if inspect.isawaitable(result):
        await result
