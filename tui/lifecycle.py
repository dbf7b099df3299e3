"""The managed server's lifecycle: start, stop, restart (after a drain or now), adoption of a running
server, and the phase it is in. It tells the app what happened through Textual messages; the app
decides what to show.

Phases: starting -> running; restart: (draining ->) restarting -> running; a failed start -> failed;
quitting with "stop": stopping. A dashboard without a managed server is in "setup" or "attached".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from textual.app import App
from textual.message import Message

from server.config import ConfigError
from server.urls import base_url
from strata_desk.launcher import LaunchError, ServerProcess, find_running, running_for

Phase = Literal["setup", "idle", "starting", "running", "draining", "restarting", "stopping", "failed", "attached"]
RestartMode = Literal["drain", "now"]
GROUP = "lifecycle"  # the app's worker group: one lifecycle step at a time


def adoptable(url: str) -> ServerProcess | None:
    """A server the state file lists at `url` with its config, so this dashboard can restart it."""
    for record in find_running():
        if base_url(record.url) == url and record.config:
            try:
                return ServerProcess.adopt(record)
            except LaunchError:
                return None
    return None


def for_config(config_path: Path) -> ServerProcess:
    """The server already running `config_path` (adopted), or a new one to start."""
    found = running_for(config_path)
    return ServerProcess.adopt(found) if found else ServerProcess(config_path)


class ServerLifecycle:
    """Owns the managed `ServerProcess` and its phase; runs each step as a worker of `app` and posts
    the messages below to it."""

    class Changed(Message):
        """The phase, progress or failure changed: redraw."""

    class Log(Message):
        """A line for the dashboard's log (source "desk")."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class Started(Message):
        """The server process runs at `url` (not yet ready): poll it and tail its log."""

        def __init__(self, url: str) -> None:
            super().__init__()
            self.url = url

    class Stopped(Message):
        """The server was stopped on the way out: the app can close."""

    def __init__(self, app: App[int], phase: Phase, *, server: ServerProcess | None = None,
                 inflight: Callable[[], int], start_timeout: float = 300.0, drain_timeout: float = 600.0) -> None:
        self.app = app
        self.server = server
        self.phase: Phase = phase
        self.progress = ""
        self.failure: tuple[str, list[str]] | None = None
        self.inflight = inflight
        self.start_timeout = start_timeout
        self.drain_timeout = drain_timeout
        self._drain_now = False

    def _changed(self) -> None:
        self.app.post_message(self.Changed())

    def _log(self, text: str) -> None:
        self.app.post_message(self.Log(text))

    def fail(self, message: str, tail: list[str]) -> None:
        self.phase = "failed"
        self.failure = (message, tail)
        self._log(message)
        self._changed()

    def _on_progress(self, text: str) -> None:
        self.progress = text
        self._changed()

    def start(self, *, restart: bool = False, stop_timeout: float = 10.0) -> None:
        """Start (or stop and start again) the server, showing progress; a failure shows why.

        stop_timeout: how long the server may take to finish its requests after SIGTERM before it
        is killed ("now" restarts use a short one)."""
        self.app.run_worker(self._start(restart, stop_timeout), group=GROUP, exclusive=True, exit_on_error=False)

    async def _start(self, restart: bool, stop_timeout: float) -> None:
        server = self.server
        assert server is not None
        self.failure = None
        self.phase = "restarting" if restart else "starting"
        self.progress = "stopping the server" if restart else "starting the server"
        self._changed()
        try:
            if restart:
                await asyncio.to_thread(server.stop, stop_timeout)
                self.progress = "starting the server"
                self._changed()
            await asyncio.to_thread(server.start)
        except (LaunchError, ConfigError, OSError) as exc:
            self.fail("The server could not be started", str(exc).splitlines())
            return
        self._log(f"server started (pid {server.pid}), waiting until it is ready")
        self.app.post_message(self.Started(server.url))
        try:
            await server.wait_ready(self.start_timeout, on_progress=self._on_progress)
        except LaunchError as exc:
            self.fail("The server and engine did not start", exc.log_tail or str(exc).splitlines())
            return
        self.phase = "running"
        self.progress = ""
        self._log("ready")
        self._changed()

    def restart(self, mode: RestartMode = "now") -> None:
        """Restart; "drain" first waits (up to drain_timeout) until no request is in flight."""
        self.app.run_worker(self._restart(mode), group=GROUP, exclusive=True, exit_on_error=False)

    async def _restart(self, mode: RestartMode) -> None:
        if mode == "drain":
            self._drain_now = False
            self.phase = "draining"
            deadline = time.monotonic() + self.drain_timeout
            self._changed()
            while self.inflight() > 0 and not self._drain_now and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                if self.phase != "draining":  # cancelled
                    return
        self.start(restart=True, stop_timeout=10.0 if mode == "drain" else 2.0)

    def restart_now(self) -> None:
        """End a drain: restart without waiting for the requests in flight."""
        self._drain_now = True

    def cancel_drain(self) -> None:
        self.app.workers.cancel_group(self.app, GROUP)
        self.phase = "running"
        self._changed()

    def stop(self) -> None:
        """Stop the server (on the way out); posts Stopped when it is down."""
        self.app.run_worker(self._stop(), group=GROUP, exclusive=True, exit_on_error=False)

    async def _stop(self) -> None:
        self.phase = "stopping"
        self._changed()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        self.app.post_message(self.Stopped())
