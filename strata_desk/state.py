"""The record of running servers (`<state dir>/servers.json`), so `attach` finds a server and the
dashboard can quit and leave it running.

Each record holds the pid and its process start time (so a reused pid is not taken for our server),
the URL, the config and the log. Writers take an fcntl lock and replace the file atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from strata_desk import paths


@dataclass(frozen=True)
class RunningServer:
    pid: int
    url: str
    config: str | None = None
    log: str | None = None
    started: float = field(default_factory=time.time)
    create_time: float | None = None  # psutil's process start time, to tell a reused pid apart

    @property
    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            return self.create_time is None or abs(proc.create_time() - self.create_time) < 1.0
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False


def state_file() -> Path:
    return paths.state_dir() / "servers.json"


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    folder = paths.state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "servers.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read() -> list[RunningServer]:
    try:
        raw = json.loads(state_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    out = []
    for item in raw if isinstance(raw, list) else []:
        try:
            out.append(RunningServer(**item))
        except TypeError:
            continue
    return out


def _write(records: list[RunningServer]) -> None:
    target = state_file()
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def process_create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def record(server: RunningServer) -> None:
    """Add (or replace, by pid) one running server."""
    with _locked():
        records = [r for r in _read() if r.pid != server.pid and r.alive]
        _write([*records, server])


def forget(pid: int) -> None:
    with _locked():
        records = _read()
        kept = [r for r in records if r.pid != pid]
        if len(kept) != len(records):
            _write(kept)


def find_running() -> list[RunningServer]:
    """The servers in the state file whose process is still alive (dead ones are dropped)."""
    with _locked():
        records = _read()
        alive = [r for r in records if r.alive]
        if len(alive) != len(records):
            _write(alive)
    return alive


def running_for(config_path: Path) -> RunningServer | None:
    """The live server started with this config, if any."""
    wanted = str(Path(config_path).resolve())
    for server in reversed(find_running()):
        if server.config and str(Path(server.config).resolve()) == wanted:
            return server
    return None
